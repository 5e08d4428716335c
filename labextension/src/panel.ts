/**
 * The "Magnitude" sidebar: model, state, slots, queue, KV usage, a tok/s sparkline, the requests
 * running now and the last ones finished. It only draws what the poller hands it.
 */
import { Widget } from '@lumino/widgets';

import {
  EngineStatus,
  RequestSummary,
  cacheLine,
  groupRequests,
  formatRate,
  kvLine,
  objectiveLine,
  kvShares,
  residentLine,
  sparklineCaption,
  sparklinePoints,
  stateLine,
  attentionLine,
  stepsLine,
  tokensLine
} from './format';

const SPARK_W = 220;
const SPARK_H = 40;

function el<K extends keyof HTMLElementTagNameMap>(tag: K, cls: string, text = ''): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  node.className = cls;
  node.textContent = text;
  return node;
}

export interface PanelActions {
  openCalibration(): Promise<void>;
  cancel(id: string): void;
  /** Show this resident model's engine (null: the server's default). */
  selectModel(id: string | null): void;
  /** Load a model now (the server loads one on the first request that needs it otherwise). */
  loadModel(id: string): Promise<void>;
}

export class MagnitudePanel extends Widget {
  private readonly fields: Record<string, HTMLElement> = {};
  private readonly kvFill: HTMLElement;
  private readonly kvCache: HTMLElement;
  private readonly spark: SVGPolylineElement;
  private readonly sparkCaption: HTMLElement;
  private readonly running: HTMLElement;
  private readonly recent: HTMLElement;
  private readonly modelSelect: HTMLSelectElement;
  private readonly residents: HTMLElement;
  private readonly loadButton: HTMLButtonElement;
  private readonly objectives: HTMLElement;

  constructor(private readonly actions: PanelActions) {
    super();
    this.id = 'magnitude-panel';
    this.addClass('mg-panel');
    this.title.caption = 'Magnitude: the local engine';

    const header = el('h2', 'mg-title', 'Magnitude');
    this.node.appendChild(header);

    // Many models: the resident ones with the memory they hold, and which one the figures below show.
    this.node.appendChild(el('h3', 'mg-subtitle', 'Models in memory'));
    this.residents = el('ul', 'mg-residents');
    this.node.appendChild(this.residents);
    const pick = el('label', 'mg-label mg-model-pick', 'show ');
    this.modelSelect = el('select', 'jp-mod-styled mg-model-select');
    this.modelSelect.onchange = () => this.actions.selectModel(this.modelSelect.value || null);
    pick.appendChild(this.modelSelect);
    this.node.appendChild(pick);
    const grid = el('dl', 'mg-grid');
    for (const [key, label] of [
      ['model', 'model'],
      ['state', 'state'],
      ['slots', 'slots in use'],
      ['waiting', 'waiting'],
      ['rate', 'tokens/s'],
      ['tokens', 'tokens generated'],
      ['steps', 'per engine step'],
      ['attention', 'attention']
    ]) {
      grid.appendChild(el('dt', 'mg-label', label));
      const value = el('dd', `mg-value mg-${key}`, '—');
      grid.appendChild(value);
      this.fields[key] = value;
    }
    this.node.appendChild(grid);
    // JupyterLab starts without a model in memory: it loads on the first request, or here.
    this.loadButton = el('button', 'jp-Button mg-load-model', 'Load the model now');
    this.loadButton.style.display = 'none';
    this.node.appendChild(this.loadButton);

    this.node.appendChild(el('div', 'mg-label', 'KV cache'));
    const bar = el('div', 'mg-kv-bar');
    this.kvFill = el('div', 'mg-kv-fill');
    this.kvCache = el('div', 'mg-kv-cache');
    bar.appendChild(this.kvFill);
    bar.appendChild(this.kvCache);
    this.fields.kv = el('div', 'mg-kv-text', '—');
    this.fields.cache = el('div', 'mg-cache-text', '—');
    this.node.appendChild(bar);
    this.node.appendChild(this.fields.kv);
    this.node.appendChild(this.fields.cache);

    const svg = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
    svg.setAttribute('class', 'mg-sparkline');
    svg.setAttribute('width', String(SPARK_W));
    svg.setAttribute('height', String(SPARK_H));
    this.spark = document.createElementNS('http://www.w3.org/2000/svg', 'polyline');
    svg.appendChild(this.spark);
    this.node.appendChild(svg);
    this.sparkCaption = el('div', 'mg-spark-caption', sparklineCaption([]));
    this.node.appendChild(this.sparkCaption);

    // Service-level objectives, as the server judges them over its window (slo: in the config).
    this.node.appendChild(el('h3', 'mg-subtitle', 'Objectives'));
    this.objectives = el('ul', 'mg-objectives');
    this.node.appendChild(this.objectives);

    const calibrate = el('button', 'jp-Button mg-open-calibration', 'Open the calibration notebook');
    calibrate.onclick = () => void this.actions.openCalibration();
    this.node.appendChild(calibrate);

    this.node.appendChild(el('h3', 'mg-subtitle', 'Running'));
    this.running = el('ul', 'mg-running');
    this.node.appendChild(this.running);
    this.node.appendChild(el('h3', 'mg-subtitle', 'Recent'));
    this.recent = el('ul', 'mg-recent');
    this.node.appendChild(this.recent);
  }

  render(status: EngineStatus | null, history: number[], error?: string): void {
    if (!status) {
      this.fields.state.textContent = error ? `offline: ${error}` : 'offline';
      return;
    }
    this.fields.model.textContent = status.model;
    this.renderModels(status);
    this.fields.state.textContent = stateLine(status.state, status.load_phase);
    this.fields.attention.textContent = attentionLine(status);
    this.fields.attention.title = status.flash_attention_reason ?? '';
    const unloaded = status.state === 'unloaded';
    this.loadButton.style.display = unloaded ? '' : 'none';
    this.loadButton.onclick = () => {
      this.loadButton.disabled = true;
      this.loadButton.textContent = 'Loading…';
      void this.actions.loadModel(status.model).finally(() => {
        this.loadButton.disabled = false;
        this.loadButton.textContent = 'Load the model now';
      });
    };
    this.fields.slots.textContent = `${status.running} / ${status.parallel}`;
    this.fields.waiting.textContent = String(status.waiting);
    this.fields.rate.textContent = formatRate(status.recent_tokens_per_s);
    this.fields.tokens.textContent = tokensLine(status);
    this.fields.steps.textContent = stepsLine(status);
    const shares = kvShares(status);
    this.kvFill.style.width = `${shares.requests.toFixed(1)}%`;
    this.kvCache.style.width = `${shares.cache.toFixed(1)}%`;
    this.fields.kv.textContent = kvLine(status);
    this.fields.cache.textContent = cacheLine(status);
    this.spark.setAttribute('points', sparklinePoints(history, SPARK_W, SPARK_H));
    this.sparkCaption.textContent = sparklineCaption(history);
    this.renderList(this.running, status.requests ?? [], true);
    this.renderList(this.recent, status.recent ?? [], false);
    this.renderObjectives(status);
  }

  private renderObjectives(status: EngineStatus): void {
    const objectives = status.slo?.objectives ?? [];
    if (!objectives.length) {
      this.objectives.replaceChildren(el('li', 'mg-objective mg-slo-none', 'none set (slo: in the config)'));
      return;
    }
    const window = `over the last ${Math.round(status.slo?.window_s ?? 0)} s`;
    this.objectives.title = window;
    this.objectives.replaceChildren(
      ...objectives.map(o => el('li', `mg-objective mg-slo-${o.color}`, objectiveLine(o)))
    );
  }

  private renderModels(status: EngineStatus): void {
    const models = status.models ?? [];
    this.residents.replaceChildren(...models.map(m => el('li', 'mg-resident', residentLine(m))));
    const wanted = ['', ...models.map(m => m.id)];
    const have = Array.from(this.modelSelect.options).map(o => o.value);
    if (wanted.join('\n') !== have.join('\n')) {
      // Rebuilt only when the resident set changes: a choice being made is not reset by each poll.
      this.modelSelect.replaceChildren(
        ...wanted.map(id => {
          const option = el('option', '', id ? id : `default (${status.default_model ?? status.model})`);
          option.value = id;
          return option;
        })
      );
    }
    this.modelSelect.value = wanted.includes(status.model) && status.model !== status.default_model ? status.model : '';
  }

  private renderList(list: HTMLElement, items: RequestSummary[], cancellable: boolean): void {
    list.replaceChildren(
      ...groupRequests(items, cancellable)
        .slice(0, 10)
        .map(group => {
          const row = el('li', 'mg-request');
          const text = el('span', 'mg-request-text', group.text);
          text.title = group.title;
          row.appendChild(text);
          if (cancellable && group.cancellable) {
            const cancel = el('button', 'jp-Button mg-cancel', group.ids.length > 1 ? 'cancel all' : 'cancel');
            cancel.onclick = () => group.ids.forEach(id => this.actions.cancel(id));
            row.appendChild(cancel);
          }
          return row;
        })
    );
  }
}

/** The status bar item: tok/s and KV %, the rest in its tooltip; a click opens the panel. */
export class MagnitudeStatusItem extends Widget {
  constructor(onClick: () => void = () => undefined) {
    super();
    this.addClass('mg-statusbar');
    this.node.textContent = 'Magnitude';
    this.node.style.cursor = 'pointer';
    this.node.onclick = onClick;
  }

  setText(line: string, color: string | null = null, tooltip = ''): void {
    this.node.textContent = line;
    this.node.title = tooltip;
    for (const c of ['green', 'amber', 'red', 'grey']) {
      this.node.classList.toggle(`mg-slo-${c}`, c === color);
    }
  }
}
