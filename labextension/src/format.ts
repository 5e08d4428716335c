/**
 * Pure helpers for the panel: numbers to text, a tok/s history to a sparkline.
 * Kept free of DOM and JupyterLab imports so jest tests them directly.
 */

export interface RequestSummary {
  id: string;
  status?: string;
  priority?: string;
  prompt_tokens: number;
  completion_tokens: number;
  age_s?: number;
  finish_reason?: string;
  ttft_ms?: number | null;
  total_ms?: number | null;
  origin?: string | null;
  prompt_head?: string | null;
}

/** The status /status gives a request waiting for its model's load (no engine has it yet). */
export const WAITING_FOR_MODEL = 'waiting for the model';

/** One request in the panel's Running or Recent list, led by where it came from (a notebook cell, a
 * batch row, a calibration level, an API client's user) where its client said. */
export function requestLine(item: RequestSummary, running: boolean): string {
  if (running && item.status === WAITING_FOR_MODEL) {
    const what = `${WAITING_FOR_MODEL} · ${Math.round(item.age_s ?? 0)} s`;
    return item.origin ? `${item.origin} · ${what}` : what;
  }
  const tokens = `${item.completion_tokens} token${item.completion_tokens === 1 ? '' : 's'}`;
  const what = running
    ? `${item.status} · ${item.priority} · ${tokens}`
    : `${item.finish_reason} · TTFT ${formatMs(item.ttft_ms)} · ${tokens}`;
  return item.origin ? `${item.origin} · ${what}` : what;
}

/** What the panel lists: one request, or the rows of one batch together (cancelled together). */
export interface RequestGroup {
  text: string;
  ids: string[];
  title: string;
  cancellable: boolean; // false for a request still waiting for its model (no engine has it to cancel)
}

// A batch row's origin: "BATCH · row LABEL · N rows" (batch.py), BATCH naming the notebook cell and DataFrame.
const BATCH_ROW = /^(.*) · row (.+) · (\d+) rows$/;

/** Requests as the panel lists them: a batch's rows in one line with how many of its rows they are,
 * led by where they came from; every other request on a line of its own. Order is kept (a batch
 * where its first row is). */
export function groupRequests(items: RequestSummary[], running: boolean): RequestGroup[] {
  const groups: RequestGroup[] = [];
  const batches = new Map<string, { group: RequestGroup; rows: RequestSummary[]; total: number; labels: string[] }>();
  for (const item of items) {
    const match = BATCH_ROW.exec(item.origin ?? '');
    if (!match) {
      const title = [item.origin, item.prompt_head ? `“${item.prompt_head}”` : null].filter(Boolean).join('\n');
      const cancellable = running && item.status !== WAITING_FOR_MODEL;
      groups.push({ text: requestLine(item, running), ids: [item.id], title, cancellable });
      continue;
    }
    const [, batch, label, total] = match;
    let entry = batches.get(batch);
    if (!entry) {
      const group = { text: '', ids: [], title: '', cancellable: running };
      entry = { group, rows: [], total: Number(total), labels: [] };
      batches.set(batch, entry);
      groups.push(entry.group);
    }
    entry.rows.push(item);
    entry.labels.push(label);
    entry.group.ids.push(item.id);
  }
  for (const [batch, { group, rows, total, labels }] of batches) {
    const tokens = rows.reduce((sum, r) => sum + r.completion_tokens, 0);
    const what = running ? 'running' : 'finished lately';
    let text = `${batch} · ${rows.length} of ${total} rows ${what} · ${tokens} token${tokens === 1 ? '' : 's'}`;
    if (!running) {
      const reasons = new Map<string, number>();
      for (const r of rows) {
        reasons.set(r.finish_reason ?? '?', (reasons.get(r.finish_reason ?? '?') ?? 0) + 1);
      }
      text += ` · ${Array.from(reasons, ([reason, n]) => `${reason} ${n}`).join(', ')}`;
    }
    group.text = text;
    const first = rows[0].prompt_head ? `\nfirst: “${rows[0].prompt_head}”` : '';
    group.title = `rows ${labels.join(', ')}${first}`;
  }
  return groups;
}

/** A model resident on the server (`/status`'s `models`). */
export interface ResidentModel {
  id: string;
  state: string;
  default?: boolean;
  running?: number;
  waiting?: number;
  recent_tokens_per_s?: number;
  memory?: { resident: number; ceiling?: number } | null;
  prefix_cache_ram_bytes?: number;
}

/** The engine thread's work since it started (`/status`'s `steps`). */
export interface StepCounts {
  decode_calls: number;
  decode_rows: number;
  decode_prompt_rows?: number;
  decode_seconds: number;
  step_seconds: number;
}

/** One service-level objective as the server judges it now (`/status`'s `slo.objectives`). */
export interface ObjectiveState {
  name: string;
  what: string;
  unit: string;
  objective: number;
  requests: number;
  current: number | null;
  compliance: number | null;
  burn_rate: number | null;
  holds: boolean | null;
  color: 'green' | 'amber' | 'red' | 'grey';
}

export interface EngineStatus {
  model: string;
  default_model?: string;
  models?: ResidentModel[];
  state: string;
  parallel: number;
  running: number;
  waiting: number;
  kv_cells_reserved: number;
  kv_cells_used: number;
  kv_cells_total: number;
  recent_tokens_per_s: number;
  prefix_cache_cells?: number;
  prefix_cache_entries?: number;
  prefix_cache_hit_rate?: number | null;
  prefix_cache_ram_entries?: number;
  admission?: string;
  preemptions?: number;
  preempted_waiting?: number;
  preempted_seconds?: number;
  generated_tokens_total?: number;
  draft_tokens_total?: number;
  draft_accepted_total?: number;
  requests?: RequestSummary[];
  recent?: RequestSummary[];
  steps?: StepCounts | null;
  slo?: { window_s: number; objectives: ObjectiveState[] };
  load_phase?: string | null;
  flash_attention?: boolean | null;
  flash_attention_source?: string | null;
  flash_attention_reason?: string | null;
}

/** Share of the KV cache reserved by running requests, 0..100 (the prefix cache's cells are not
 * reserved: the cache gives them back when a request needs them). */
export function kvPercent(
  status: Pick<EngineStatus, 'kv_cells_reserved' | 'kv_cells_total' | 'prefix_cache_cells'>
): number {
  return kvShares(status).requests;
}

/** The KV cache in three shares, 0..100 each: reserved by running requests, held by the prefix cache, free. */
export function kvShares(
  status: Pick<EngineStatus, 'kv_cells_reserved' | 'kv_cells_total' | 'prefix_cache_cells'>
): { requests: number; cache: number; free: number } {
  const total = status.kv_cells_total;
  if (!total) {
    return { requests: 0, cache: 0, free: 100 };
  }
  const clamp = (n: number) => Math.max(0, Math.min(100, n));
  const cache = clamp((100 * (status.prefix_cache_cells ?? 0)) / total);
  const requests = clamp((100 * status.kv_cells_reserved) / total - cache);
  return { requests, cache, free: clamp(100 - requests - cache) };
}

/** The KV cells: reserved by requests, held by the cache, free; and, where cells are charged by
 * estimate, the preemptions that took them back. */
export function kvLine(status: EngineStatus): string {
  const cached = status.prefix_cache_cells ?? 0;
  const cells =
    `${status.kv_cells_reserved - cached} reserved · ${cached} cached · ` +
    `${status.kv_cells_total - status.kv_cells_reserved} free of ${status.kv_cells_total} cells`;
  const preemptions = status.preemptions ?? 0;
  if (status.admission !== 'estimate' && !preemptions) {
    return cells;
  }
  const waiting = status.preempted_waiting ?? 0;
  const paused = preemptions ? `, ${(status.preempted_seconds ?? 0).toFixed(1)} s paused` : '';
  const now = waiting ? `, ${waiting} waiting to resume` : '';
  return `${cells} · ${preemptions} preemption${preemptions === 1 ? '' : 's'}${now}${paused}`;
}

/** One line about the prefix cache: entries, cells, and the share of prompt tokens it served. */
export function cacheLine(status: EngineStatus): string {
  const entries = status.prefix_cache_entries ?? 0;
  const rate = status.prefix_cache_hit_rate;
  const hits = rate === null || rate === undefined ? '—' : `${Math.round(rate * 100)}%`;
  const ram = status.prefix_cache_ram_entries ?? 0;
  const saved = ram ? `, ${ram} more in RAM` : '';
  return `cache: ${entries} ${entries === 1 ? 'entry' : 'entries'}, ${status.prefix_cache_cells ?? 0} cells${saved}, ${hits} of prompt tokens reused`;
}

/** Where the engine thread's time goes, per llama_decode call since it started: inside the call (and
 * the rows it computed), and the rest of the step (planning, sampling, events). */
export function stepsLine(status: Pick<EngineStatus, 'steps'>): string {
  const steps = status.steps;
  if (!steps || !steps.decode_calls) {
    return '—';
  }
  const calls = steps.decode_calls;
  const decode = (1000 * steps.decode_seconds) / calls;
  const rest = (1000 * Math.max(0, steps.step_seconds - steps.decode_seconds)) / calls;
  const rows = steps.decode_rows / calls;
  return `${decode.toFixed(1)} ms llama_decode (${rows.toFixed(1)} rows) + ${rest.toFixed(1)} ms rest, × ${calls}`;
}

/** Tokens generated, and how many prompt-lookup drafts were kept of those decoded. */
export function tokensLine(status: EngineStatus): string {
  const generated = String(status.generated_tokens_total ?? 0);
  const drafted = status.draft_tokens_total ?? 0;
  if (!drafted) {
    return generated;
  }
  const kept = status.draft_accepted_total ?? 0;
  return `${generated} (drafts: ${kept} of ${drafted} kept, ${Math.round((100 * kept) / drafted)}%)`;
}

export function formatRate(tokensPerSecond: number): string {
  if (!Number.isFinite(tokensPerSecond) || tokensPerSecond <= 0) {
    return '0 tok/s';
  }
  return tokensPerSecond >= 100
    ? `${Math.round(tokensPerSecond)} tok/s`
    : `${tokensPerSecond.toFixed(1)} tok/s`;
}

export function formatMs(ms: number | null | undefined): string {
  if (ms === null || ms === undefined || !Number.isFinite(ms)) {
    return '—';
  }
  return ms >= 1000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms)} ms`;
}

/** One objective in words: what, its value now against its limit, and whether it holds. */
export function objectiveLine(o: ObjectiveState): string {
  const rate = o.unit === 'tok/s';
  const value = (n: number) => (rate ? `${n.toFixed(1)} tok/s` : formatMs(n));
  const now = o.current === null ? 'no requests yet' : value(o.current);
  const within = o.compliance === null ? '' : ` · ${Math.round(o.compliance * 100)}% within`;
  const verdict = o.holds === null ? '' : o.holds ? ' · holds' : ' · BROKEN';
  return `${o.what}: ${now} (${rate ? '≥' : '≤'} ${value(o.objective)})${within}${verdict}`;
}

/** The objectives' worst colour: red if one is broken, amber if one has spent half its budget. */
export function sloColor(status: Partial<EngineStatus> | null): ObjectiveState['color'] | null {
  const objectives = status?.slo?.objectives ?? [];
  if (!objectives.length) {
    return null;
  }
  for (const color of ['red', 'amber', 'green'] as const) {
    if (objectives.some(o => o.color === color)) {
      return color;
    }
  }
  return 'grey';
}

/** The status bar's one line. */
export function statusLine(status: EngineStatus | null): string {
  if (!status) {
    return 'Magnitude: offline';
  }
  if (status.state !== 'ready') {
    return `Magnitude: ${status.state}`;
  }
  const line = `${formatRate(status.recent_tokens_per_s)} · KV ${Math.round(kvPercent(status))}%`;
  const objectives = status.slo?.objectives ?? [];
  const broken = objectives.filter(o => o.holds === false).length;
  if (!objectives.length) {
    return line;
  }
  return `${line} · SLO ${broken ? `${broken} broken` : 'ok'}`;
}

/** The KV cache in the tooltip: what requests reserve, what the prefix cache holds (it gives it back). */
function kvTooltipLine(status: EngineStatus): string {
  const shares = kvShares(status);
  const cached = status.prefix_cache_cells ?? 0;
  const reserved = status.kv_cells_reserved - cached;
  const cache = cached ? `, ${Math.round(shares.cache)}% cached (${cached} cells)` : '';
  return `KV cache: ${Math.round(shares.requests)}% reserved (${reserved} of ${status.kv_cells_total} cells)${cache}`;
}

/** The status bar item's tooltip: model, slots, queue, KV cache and the objectives, one a line. */
export function statusTooltip(status: EngineStatus | null): string {
  if (!status) {
    return 'Magnitude: the server does not answer. Click to open the panel.';
  }
  const lines = [
    `model: ${status.model} (${status.state})`,
    `slots: ${status.running} of ${status.parallel} in use, ${status.waiting} waiting`,
    kvTooltipLine(status),
    `tokens/s: ${formatRate(status.recent_tokens_per_s)}`
  ];
  for (const o of status.slo?.objectives ?? []) {
    lines.push(objectiveLine(o));
  }
  lines.push('Click to open the Magnitude panel.');
  return lines.join('\n');
}

/** What the sparkline shows, in words: its span and its scale (its top is the peak). */
export function sparklineCaption(history: number[], pollSeconds = 1): string {
  if (!history.length) {
    return 'tokens/s: no figures yet';
  }
  const peak = Math.max(...history);
  const span = Math.round(history.length * pollSeconds);
  return `tokens/s over the last ${span} s · top of the line: ${formatRate(peak)} · now ${formatRate(history[history.length - 1])}`;
}

/** Keep the last `size` values (a rolling window for the sparkline). */
export function pushHistory(history: number[], value: number, size = 60): number[] {
  const next = [...history, Number.isFinite(value) ? value : 0];
  return next.length > size ? next.slice(next.length - size) : next;
}

/** SVG polyline points for a sparkline of `values` in a width × height box (y grows downwards). */
export function sparklinePoints(values: number[], width: number, height: number): string {
  if (values.length === 0) {
    return '';
  }
  const max = Math.max(...values, 1e-9);
  const step = values.length > 1 ? width / (values.length - 1) : 0;
  return values
    .map((v, i) => {
      const x = i * step;
      const y = height - (Math.max(0, v) / max) * height;
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    })
    .join(' ');
}

export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) {
    return '—';
  }
  const mib = bytes / 2 ** 20;
  return mib >= 1024 ? `${(mib / 1024).toFixed(1)} GiB` : `${Math.round(mib)} MiB`;
}

/** One resident model in a line: state, memory it holds, requests, tok/s. */
export function residentLine(model: ResidentModel): string {
  const memory = (model.memory?.resident ?? 0) + (model.prefix_cache_ram_bytes ?? 0);
  const parts = [model.id + (model.default ? ' (default)' : ''), model.state, formatBytes(memory)];
  const busy = (model.running ?? 0) + (model.waiting ?? 0);
  if (busy) {
    parts.push(`${busy} request${busy === 1 ? '' : 's'}`);
  }
  if (model.recent_tokens_per_s) {
    parts.push(formatRate(model.recent_tokens_per_s));
  }
  return parts.join(' · ');
}

/** The model the panel should show: the one picked if it is still resident, else the server's choice. */
export function chosenModel(picked: string | null, status: EngineStatus | null): string | null {
  if (!picked || !status?.models) {
    return null;
  }
  return status.models.some(m => m.id === picked) ? picked : null;
}

/** A model's state in words: "unloaded" is a model not yet in memory, which loads when first used. */
export function stateLine(state: string, phase?: string | null): string {
  if (state === 'unloaded') {
    return 'no model loaded yet (loads on the first request)';
  }
  return state === 'loading' && phase ? `loading: ${phase}` : state;
}

const ATTENTION_SOURCES: Record<string, string> = {
  set: 'set in the config',
  measured: 'measured at load',
  remembered: 'measured at an earlier load',
  default: "the CPU family's default, measured at the next load"
};

/** Which attention kernel runs, and how it was chosen: "flash attention on · measured at load". */
export function attentionLine(
  status: Pick<EngineStatus, 'flash_attention' | 'flash_attention_source'>
): string {
  if (status.flash_attention === null || status.flash_attention === undefined) {
    return '—';
  }
  const kind = `flash attention ${status.flash_attention ? 'on' : 'off'}`;
  const source = status.flash_attention_source;
  return source ? `${kind} · ${ATTENTION_SOURCES[source] ?? source}` : kind;
}

/** The id of an open document whose file is called `name` (in any folder), if one is open. */
export function openDocumentNamed(
  widgets: Iterable<{ id: string; context?: { path?: string } }>,
  name: string
): string | null {
  for (const widget of widgets) {
    const path = widget.context?.path ?? '';
    if (path === name || path.endsWith(`/${name}`)) {
      return widget.id;
    }
  }
  return null;
}
