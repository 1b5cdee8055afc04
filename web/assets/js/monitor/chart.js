// A small time-series chart on a canvas: one filled line over the last ``span`` seconds (the
// window grows from ``minSpan`` while the page has seen less history than that).

function niceMax(value) {
  if (!(value > 0)) return 1;
  const base = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (value <= step * base) return step * base;
  return 10 * base;
}

function compact(n) {
  if (n >= 10000) return `${Math.round(n / 1000)}k`;
  if (n >= 1000) return `${(n / 1000).toFixed(1)}k`;
  return Number.isInteger(n) || n >= 10 ? `${Math.round(n)}` : n.toFixed(1);
}

export class TimeChart {
  constructor(canvas, { span = 120, minSpan = 30 } = {}) {
    this.canvas = canvas;
    this.maxSpan = span;
    this.minSpan = minSpan;
    this.span = minSpan;
    this.points = [];  // [seconds, value]
    new ResizeObserver(() => this.draw()).observe(canvas);
  }

  push(t, value) {
    this.points.push([t, Number.isFinite(value) ? value : 0]);
    while (this.points.length && this.points[0][0] < t - this.maxSpan - 2) this.points.shift();
    const seen = t - this.points[0][0];
    this.span = Math.min(this.maxSpan, Math.max(this.minSpan, Math.ceil(seen / 30) * 30));
    this.draw();
  }

  draw() {
    const { canvas } = this;
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth;
    const h = canvas.clientHeight;
    if (!w || !h) return;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const css = getComputedStyle(canvas);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);

    const left = 38;
    const bottom = h - 18;
    const top = 6;
    const right = w - 4;
    const now = this.points.length ? this.points[this.points.length - 1][0] : 0;
    const max = niceMax(Math.max(0, ...this.points.map((p) => p[1])) * 1.1);
    const x = (t) => right - ((now - t) / this.span) * (right - left);
    const y = (v) => bottom - (v / max) * (bottom - top);

    ctx.font = `11px ${css.fontFamily}`;
    ctx.fillStyle = css.getPropertyValue("--muted");
    ctx.strokeStyle = css.getPropertyValue("--border");
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (const frac of [0, 0.5, 1]) {
      const yy = Math.round(y(max * frac)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(left, yy);
      ctx.lineTo(right, yy);
      ctx.stroke();
      ctx.fillText(compact(max * frac), left - 6, yy);
    }
    ctx.textBaseline = "alphabetic";
    ctx.textAlign = "left";
    ctx.fillText(this.span >= 60 ? `−${this.span / 60} min` : `−${this.span} s`, left, h - 3);
    ctx.textAlign = "right";
    ctx.fillText("now", right, h - 3);

    const pts = this.points.filter((p) => p[0] >= now - this.span);
    if (pts.length < 2) return;
    const accent = css.getPropertyValue("--accent").trim();
    ctx.beginPath();
    ctx.moveTo(x(pts[0][0]), bottom);
    for (const [t, v] of pts) ctx.lineTo(x(t), y(v));
    ctx.lineTo(x(pts[pts.length - 1][0]), bottom);
    ctx.closePath();
    ctx.globalAlpha = 0.18;
    ctx.fillStyle = accent;
    ctx.fill();
    ctx.globalAlpha = 1;
    ctx.beginPath();
    pts.forEach(([t, v], i) => (i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
    ctx.strokeStyle = accent;
    ctx.lineWidth = 1.75;
    ctx.lineJoin = "round";
    ctx.stroke();
  }
}
