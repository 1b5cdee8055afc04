// The settings dialog's form, and the one-line summary under the composer.

const NUMBERS = ["temperature", "top_p", "max_tokens"];

export function fillForm(form, settings, key) {
  const f = form.elements;
  f.system.value = settings.system;
  for (const name of NUMBERS) f[name].value = settings[name] ?? "";
  f.thinking.checked = !!settings.thinking;
  f.api_key.value = key;
}

/** {settings, key} from the form; blank numbers mean the server's default (null). */
export function readForm(form) {
  const f = form.elements;
  const num = (v) => (v.trim() === "" || !Number.isFinite(Number(v)) ? null : Number(v));
  const maxTokens = num(f.max_tokens.value);
  return {
    settings: {
      system: f.system.value.trim(),
      temperature: num(f.temperature.value),
      top_p: num(f.top_p.value),
      max_tokens: maxTokens == null ? null : Math.max(1, Math.round(maxTokens)),
      thinking: f.thinking.checked,
    },
    key: f.api_key.value.trim(),
  };
}

export function summary(s) {
  return [
    s.temperature != null ? `temperature ${s.temperature}` : null,
    s.top_p != null ? `top-p ${s.top_p}` : null,
    s.max_tokens != null ? `max ${s.max_tokens} tokens` : null,
    `thinking ${s.thinking ? "on" : "off"}`,
    s.system ? "system prompt set" : null,
  ].filter(Boolean).join(" · ");
}
