// A few line icons (24x24, stroked with the current colour).

const PATHS = {
  plus: "M12 5v14M5 12h14",
  menu: "M4 6h16M4 12h16M4 18h16",
  send: "M5 12h13M13 6l6 6-6 6",
  stop: "M7 7h10v10H7z",
  copy: "M9 9h10v10H9zM5 15V5h10",
  edit: "M4 20h4L19 9l-4-4L4 16zM13.5 6.5l4 4",
  trash: "M4 7h16M10 11v6M14 11v6M6 7l1 13h10l1-13M9 7V4h6v3",
  refresh: "M20 11a8 8 0 1 0-2.3 5.7M20 4v7h-7",
  download: "M12 4v11M7 10l5 5 5-5M5 20h14",
  upload: "M12 20V9M7 14l5-5 5 5M5 4h14",
  settings: "M12 15a3 3 0 1 0 0-6 3 3 0 0 0 0 6zM19 12l2-1-1-3-2 .3-1.4-1.4.3-2-3-1-1 2h-2l-1-2-3 1 .3 2L6.8 7.3l-2-.3-1 3 2 1v2l-2 1 1 3 2-.3 1.4 1.4-.3 2 3 1 1-2h2l1 2 3-1-.3-2 1.4-1.4 2 .3 1-3-2-1z",
  chart: "M4 20V4M4 20h16M8 16l4-5 3 3 5-7",
  rename: "M4 7V5h16v2M12 5v14M9 19h6",
  check: "M5 12l5 5 9-10",
  x: "M6 6l12 12M18 6L6 18",
  chat: "M4 5h16v11H9l-5 4z",
  image: "M4 5h16v14H4zM4 16l5-5 4 4 2-2 5 5M15 9.5a1 1 0 1 0 0-.01",
};

export function icon(name, label = "") {
  const title = label ? `<title>${label}</title>` : "";
  return `<svg class="i" viewBox="0 0 24 24" aria-hidden="${label ? "false" : "true"}">${title}<path d="${PATHS[name]}"/></svg>`;
}
