import {
  attentionLine,
  cacheLine,
  chosenModel,
  formatBytes,
  formatMs,
  kvLine,
  kvShares,
  formatRate,
  groupRequests,
  kvPercent,
  objectiveLine,
  openDocumentNamed,
  pushHistory,
  requestLine,
  residentLine,
  sloColor,
  sparklineCaption,
  sparklinePoints,
  stateLine,
  statusLine,
  statusTooltip,
  stepsLine,
  tokensLine
} from '../format';

const ready = {
  model: 'smollm2-135m',
  state: 'ready',
  parallel: 8,
  running: 2,
  waiting: 1,
  kv_cells_reserved: 2048,
  kv_cells_used: 300,
  kv_cells_total: 8192,
  recent_tokens_per_s: 57.25
};

describe('format', () => {
  it('computes the KV share, clamped and safe on an empty cache', () => {
    expect(kvPercent(ready)).toBe(25);
    expect(kvPercent({ kv_cells_reserved: 5, kv_cells_total: 0 })).toBe(0);
    expect(kvPercent({ kv_cells_reserved: 20, kv_cells_total: 10 })).toBe(100);
    // at idle the prefix cache holds cells nobody reserves: 0%, not the cache's share
    expect(kvPercent({ kv_cells_reserved: 4063, kv_cells_total: 8192, prefix_cache_cells: 4063 })).toBe(0);
    const idle = { ...ready, running: 0, waiting: 0, kv_cells_reserved: 4063, prefix_cache_cells: 4063 };
    expect(statusLine(idle)).toBe('57.3 tok/s · KV 0%');
    expect(statusTooltip(idle)).toContain('KV cache: 0% reserved (0 of 8192 cells), 50% cached (4063 cells)');
  });

  it('splits the KV cache into requests, prefix cache and free', () => {
    expect(kvShares({ ...ready, prefix_cache_cells: 1024 })).toEqual({ requests: 12.5, cache: 12.5, free: 75 });
    expect(kvShares({ kv_cells_reserved: 0, kv_cells_total: 0 })).toEqual({ requests: 0, cache: 0, free: 100 });
    expect(cacheLine({ ...ready, prefix_cache_entries: 3, prefix_cache_cells: 900, prefix_cache_hit_rate: 0.614 })).toBe(
      'cache: 3 entries, 900 cells, 61% of prompt tokens reused'
    );
    expect(cacheLine({ ...ready, prefix_cache_entries: 1, prefix_cache_cells: 90, prefix_cache_ram_entries: 2 })).toBe(
      'cache: 1 entry, 90 cells, 2 more in RAM, — of prompt tokens reused'
    );
    expect(cacheLine({ ...ready, prefix_cache_entries: 1 })).toBe('cache: 1 entry, 0 cells, — of prompt tokens reused');
  });

  it('says where the KV cells are, and the preemptions when cells are charged by estimate', () => {
    const cells = { ...ready, kv_cells_reserved: 300, kv_cells_total: 1000, prefix_cache_cells: 100 };
    expect(kvLine(cells)).toBe('200 reserved · 100 cached · 700 free of 1000 cells');
    expect(kvLine({ ...cells, admission: 'estimate' })).toBe(
      '200 reserved · 100 cached · 700 free of 1000 cells · 0 preemptions'
    );
    expect(
      kvLine({ ...cells, admission: 'estimate', preemptions: 3, preempted_waiting: 1, preempted_seconds: 2.14 })
    ).toBe('200 reserved · 100 cached · 700 free of 1000 cells · 3 preemptions, 1 waiting to resume, 2.1 s paused');
    expect(kvLine({ ...cells, admission: 'estimate', preemptions: 1, preempted_seconds: 0.5 })).toBe(
      '200 reserved · 100 cached · 700 free of 1000 cells · 1 preemption, 0.5 s paused'
    );
  });

  it('says how many drafts were kept, and nothing about drafts where none were made', () => {
    expect(tokensLine({ ...ready, generated_tokens_total: 120 })).toBe('120');
    expect(tokensLine({ ...ready, generated_tokens_total: 120, draft_tokens_total: 50, draft_accepted_total: 40 })).toBe(
      '120 (drafts: 40 of 50 kept, 80%)'
    );
  });

  it('formats rates and durations', () => {
    expect(formatRate(57.25)).toBe('57.3 tok/s');
    expect(formatRate(123.4)).toBe('123 tok/s');
    expect(formatRate(NaN)).toBe('0 tok/s');
    expect(formatMs(250.4)).toBe('250 ms');
    expect(formatMs(2500)).toBe('2.5 s');
    expect(formatMs(null)).toBe('—');
  });

  it('writes the status bar line for each state', () => {
    expect(statusLine(ready)).toBe('57.3 tok/s · KV 25%');
    expect(statusLine({ ...ready, state: 'loading' })).toBe('Magnitude: loading');
    expect(statusLine(null)).toBe('Magnitude: offline');
  });

  it('keeps a rolling history', () => {
    let h: number[] = [];
    for (let i = 0; i < 5; i++) {
      h = pushHistory(h, i, 3);
    }
    expect(h).toEqual([2, 3, 4]);
  });

  it('draws a sparkline scaled to its box', () => {
    expect(sparklinePoints([], 100, 20)).toBe('');
    expect(sparklinePoints([0, 5, 10], 100, 20)).toBe('0.0,20.0 50.0,10.0 100.0,0.0');
    expect(sparklinePoints([3], 100, 20)).toBe('0.0,0.0');
  });
});

describe('many models', () => {
  const models = [
    { id: 'smollm2-135m', state: 'ready', default: true, memory: { resident: 420 * 2 ** 20 }, prefix_cache_ram_bytes: 10 * 2 ** 20 },
    { id: 'smol-q8', state: 'loading', running: 1, waiting: 1, recent_tokens_per_s: 12.5, memory: { resident: 2.5 * 2 ** 30 } }
  ];

  it('describes a resident model in one line', () => {
    expect(residentLine(models[0])).toBe('smollm2-135m (default) · ready · 430 MiB');
    expect(residentLine(models[1])).toBe('smol-q8 · loading · 2.5 GiB · 2 requests · 12.5 tok/s');
    expect(formatBytes(undefined)).toBe('—');
  });

  it('keeps a picked model only while it is resident', () => {
    const status = { ...ready, models };
    expect(chosenModel('smol-q8', status)).toBe('smol-q8');
    expect(chosenModel('gone', status)).toBeNull();
    expect(chosenModel(null, status)).toBeNull();
    expect(chosenModel('smol-q8', null)).toBeNull();
  });

  it('splits an engine step into llama_decode and the rest, per call', () => {
    expect(stepsLine({})).toBe('—');
    expect(stepsLine({ steps: { decode_calls: 0, decode_rows: 0, decode_seconds: 0, step_seconds: 0 } })).toBe('—');
    const steps = { decode_calls: 200, decode_rows: 3000, decode_seconds: 26, step_seconds: 26.3 };
    expect(stepsLine({ steps })).toBe('130.0 ms llama_decode (15.0 rows) + 1.5 ms rest, × 200');
  });

  it('says in words that a model not yet loaded loads on the first request', () => {
    expect(stateLine('unloaded')).toBe('no model loaded yet (loads on the first request)');
    expect(stateLine('ready')).toBe('ready');
  });

  it('says what a loading model is doing', () => {
    expect(stateLine('loading', 'measuring the attention kernels (step 5 of 36)')).toBe(
      'loading: measuring the attention kernels (step 5 of 36)'
    );
    expect(stateLine('loading', null)).toBe('loading');
  });

  it('says which attention kernel runs and how it was chosen', () => {
    expect(attentionLine({ flash_attention: true, flash_attention_source: 'measured' })).toBe(
      'flash attention on · measured at load'
    );
    expect(attentionLine({ flash_attention: false, flash_attention_source: 'default' })).toBe(
      "flash attention off · the CPU family's default, measured at the next load"
    );
    expect(attentionLine({ flash_attention: null })).toBe('—');
  });
});

describe('objectives', () => {
  const ttft = {
    name: 'ttft_p95_ms',
    what: 'TTFT p95',
    unit: 'ms',
    objective: 2000,
    requests: 40,
    current: 850,
    compliance: 0.99,
    burn_rate: 0.2,
    holds: true,
    color: 'green' as const
  };
  const rate = {
    ...ttft,
    name: 'min_tokens_per_s',
    what: 'output tok/s (p5)',
    unit: 'tok/s',
    objective: 10,
    current: 7.25,
    compliance: 0.8,
    burn_rate: 4,
    holds: false,
    color: 'red' as const
  };

  it('says each objective in words, against its limit', () => {
    expect(objectiveLine(ttft)).toBe('TTFT p95: 850 ms (≤ 2.0 s) · 99% within · holds');
    expect(objectiveLine(rate)).toBe('output tok/s (p5): 7.3 tok/s (≥ 10.0 tok/s) · 80% within · BROKEN');
    expect(objectiveLine({ ...ttft, current: null, compliance: null, holds: null, color: 'grey' })).toBe(
      'TTFT p95: no requests yet (≤ 2.0 s)'
    );
  });

  it('colours the status bar by the worst objective and counts the broken ones', () => {
    const status = { ...ready, slo: { window_s: 300, objectives: [ttft, rate] } };
    expect(sloColor(status)).toBe('red');
    expect(sloColor({ slo: { window_s: 300, objectives: [ttft] } })).toBe('green');
    expect(sloColor(ready)).toBeNull();
    expect(statusLine(status)).toBe('57.3 tok/s · KV 25% · SLO 1 broken');
    expect(statusLine({ ...ready, slo: { window_s: 300, objectives: [ttft] } })).toBe('57.3 tok/s · KV 25% · SLO ok');
  });
});

describe('requestLine', () => {
  it('leads with where the request came from', () => {
    const running = { id: 'a', status: 'running', priority: 'batch', prompt_tokens: 9, completion_tokens: 1 };
    expect(requestLine(running, true)).toBe('running · batch · 1 token');
    expect(requestLine({ ...running, origin: 'reviews · row 12' }, true)).toBe(
      'reviews · row 12 · running · batch · 1 token'
    );
    const done = { ...running, finish_reason: 'length', ttft_ms: 1100, completion_tokens: 8, origin: '01_first_prompts.ipynb · cell 3' };
    expect(requestLine(done, false)).toBe('01_first_prompts.ipynb · cell 3 · length · TTFT 1.1 s · 8 tokens');
  });

  it('lists a request waiting for its model under its cell, with no cancel', () => {
    const waiting = {
      id: 'w',
      status: 'waiting for the model',
      priority: 'interactive',
      prompt_tokens: 0,
      completion_tokens: 0,
      age_s: 4.6,
      origin: '01_first_prompts.ipynb · cell 2'
    };
    expect(requestLine(waiting, true)).toBe('01_first_prompts.ipynb · cell 2 · waiting for the model · 5 s');
    const [group] = groupRequests([waiting], true);
    expect(group.cancellable).toBe(false);
    expect(groupRequests([{ ...waiting, status: 'running' }], true)[0].cancellable).toBe(true);
  });
});

describe('the panel names things', () => {
  const row = (id: string, label: string, tokens: number, finish?: string) => ({
    id,
    status: 'running',
    priority: 'batch',
    prompt_tokens: 20,
    completion_tokens: tokens,
    finish_reason: finish,
    origin: `02_prompts.ipynb · cell 7 · reviews · row ${label} · 40 rows`
  });

  it("groups a batch's rows under their batch, with how many of its rows they are", () => {
    const lone = {
      id: 'x',
      status: 'running',
      priority: 'interactive',
      prompt_tokens: 5,
      completion_tokens: 2,
      origin: 'ada',
      prompt_head: 'Name three uses of a paperclip'
    };
    const groups = groupRequests([row('a', '3', 4), lone, row('b', '4', 1)], true);
    expect(groups.map(g => g.text)).toEqual([
      '02_prompts.ipynb · cell 7 · reviews · 2 of 40 rows running · 5 tokens',
      'ada · running · interactive · 2 tokens'
    ]);
    expect(groups[1].title).toBe('ada\n“Name three uses of a paperclip”');
    expect(groups[0].ids).toEqual(['a', 'b']);
    expect(groups[0].title).toBe('rows 3, 4');
    const done = groupRequests([row('a', '3', 4, 'stop'), row('b', '4', 8, 'length'), row('c', '5', 2, 'stop')], false);
    expect(done[0].text).toBe('02_prompts.ipynb · cell 7 · reviews · 3 of 40 rows finished lately · 14 tokens · stop 2, length 1');
  });

  it('gives the status bar a tooltip with the model, slots, queue, KV cache and objectives', () => {
    const tip = statusTooltip({ ...ready, slo: { window_s: 300, objectives: [] } });
    expect(tip.split('\n')).toEqual([
      'model: smollm2-135m (ready)',
      'slots: 2 of 8 in use, 1 waiting',
      'KV cache: 25% reserved (2048 of 8192 cells)',
      'tokens/s: 57.3 tok/s',
      'Click to open the Magnitude panel.'
    ]);
    expect(statusTooltip(null)).toContain('does not answer');
  });

  it('says what the sparkline spans and what its top stands for', () => {
    expect(sparklineCaption([])).toBe('tokens/s: no figures yet');
    expect(sparklineCaption([10, 40, 20])).toBe('tokens/s over the last 3 s · top of the line: 40.0 tok/s · now 20.0 tok/s');
  });

  it('finds the calibration notebook where a participant has it open', () => {
    const widgets = [
      { id: 'launcher' },
      { id: 'nb-1', context: { path: 'workshop/01_first_prompts.ipynb' } },
      { id: 'nb-3', context: { path: 'workshop/03_calibration.ipynb' } }
    ];
    expect(openDocumentNamed(widgets, '03_calibration.ipynb')).toBe('nb-3');
    expect(openDocumentNamed(widgets, '07_agents.ipynb')).toBeNull();
    expect(openDocumentNamed([{ id: 'root', context: { path: '03_calibration.ipynb' } }], '03_calibration.ipynb')).toBe('root');
  });
});
