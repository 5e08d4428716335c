// One workshop notebook as a participant meets it in JupyterLab: Run All Cells, then what they must
// see: no traceback, no "Error displaying widget", no output wider than its cell. Where the notebook
// has a calibration widget, press its Start, and its verdict names the knee and compares this run with
// the cell's above it. Then the notebook is saved (the test reads its outputs from the file) and the
// Magnitude panel's Recent list is read: its entries name the cells they came from. The lines cells
// showed while the model loaded are recorded as they appeared (the first notebook loads it). Prints a JSON
// result (a screenshot of the page where it fails). The lab runs with expose_app_in_browser.
import assert from 'node:assert/strict';
import { inLab, labUrl, token } from './lab.mjs';

const notebook = process.env.NOTEBOOK; // a path under the Jupyter root

await inLab(Number(process.env.UI_TIMEOUT_MS ?? 900_000), async page => {
  // A workspace of its own: one lab runs every notebook, and the default workspace would reopen the last.
  const workspace = notebook.replace(/[^A-Za-z0-9]/g, '-');
  await page.goto(`${labUrl}lab/workspaces/${workspace}/tree/${notebook}?token=${token}`);
  await page.waitForSelector('.jp-Notebook .jp-Cell');
  await page.waitForFunction(() => /\|\s*Idle/.test(document.querySelector('.jp-StatusBar-Widget')?.textContent ?? ''));
  // The lines a cell shows while its model loads ("loading smollm2-135m … …, 3 s") go once it is
  // loaded: each is recorded as it appears, looking only at the outputs that changed.
  await page.evaluate(() => {
    const lines = (window.magnitudeLoadingLines = []);
    const seen = output => {
      const line = (output.textContent ?? '').trim();
      if (line.startsWith('loading ') && !lines.includes(line)) lines.push(line);
    };
    window.magnitudeLoadingObserver = new MutationObserver(mutations => {
      for (const m of mutations) {
        const target = m.target.nodeType === 1 ? m.target : m.target.parentElement;
        const inside = target?.closest('.jp-OutputArea-output');
        if (inside) seen(inside);
        for (const node of m.addedNodes) {
          if (node.nodeType !== 1) continue;
          if (node.matches('.jp-OutputArea-output')) seen(node);
          node.querySelectorAll('.jp-OutputArea-output').forEach(seen);
        }
      }
    });
    window.magnitudeLoadingObserver.observe(document.querySelector('.jp-Notebook'), {
      childList: true,
      subtree: true,
      characterData: true
    });
  });
  await page.locator('.lm-MenuBar-itemLabel', { hasText: /^Run$/ }).click();
  await page.locator('.lm-Menu-itemLabel', { hasText: /^Run All Cells$/ }).click();
  // Done: every code cell has its execution count, and the kernel is idle again.
  await page.waitForFunction(() => {
    const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(p => p.textContent ?? '');
    const idle = /\|\s*Idle/.test(document.querySelector('.jp-StatusBar-Widget')?.textContent ?? '');
    return idle && prompts.length > 0 && prompts.every(p => /\[\d+\]/.test(p));
  });
  await page.evaluate(() => window.magnitudeLoadingObserver.disconnect());
  await page.waitForTimeout(2000);
  let verdict = null;
  const start = page.locator('.jp-OutputArea button', { hasText: /^Start$/ });
  if (await start.count()) {
    await start.first().click();
    await page.waitForFunction(() => /This run: knee|Stopped before/.test(document.querySelector('.jp-Notebook')?.textContent ?? ''));
    verdict = await page.evaluate(() => {
      const html = [...document.querySelectorAll('.widget-html-content')].map(e => e.textContent ?? '');
      return html.find(t => t.startsWith('This run:')) ?? null;
    });
  }
  const found = await page.evaluate(() => {
    const outputs = [...document.querySelectorAll('.jp-OutputArea-output')];
    const text = outputs.map(o => o.textContent ?? '').join('\n');
    const wide = outputs
      .filter(o => o.scrollWidth > o.clientWidth + 2 && !o.querySelector('pre, table, .js-plotly-plot'))
      .map(o => (o.textContent ?? '').slice(0, 80));
    return {
      tracebacks: outputs.filter(o => /Traceback \(most recent call last\)/.test(o.textContent ?? '')).length,
      widgetErrors: (text.match(/Error displaying widget/g) ?? []).length,
      wide,
      cells: document.querySelectorAll('.jp-CodeCell').length
    };
  });
  // Saved as the participant would (File > Save), so that the test reads what the page showed.
  await page.evaluate(() => window.jupyterapp.commands.execute('docmanager:save'));
  await page.waitForFunction(() => !document.querySelector('.lm-DockPanel-tabBar .jp-mod-current.jp-mod-dirty'));
  await page.locator('.jp-SideBar [data-id="magnitude-panel"]').click();
  await page.locator('#magnitude-panel').waitFor({ state: 'visible' });
  // A notebook whose requests went to this lab's server has them listed within a refresh or two
  // (waited for where the test checks them: other notebooks may send theirs elsewhere).
  if (process.env.EXPECT_RECENT) {
    await page.waitForSelector('#magnitude-panel .mg-recent .mg-request', { timeout: 10_000 }).catch(() => {});
  }
  const recent = await page.locator('#magnitude-panel .mg-recent .mg-request-text').allTextContents();
  const loading = await page.evaluate(() => window.magnitudeLoadingLines);
  assert.equal(found.tracebacks, 0, 'a traceback in an output');
  assert.equal(found.widgetErrors, 0, 'a widget failed to display');
  assert.deepEqual(found.wide, [], 'an output wider than its cell');
  console.log(JSON.stringify({ ok: true, verdict, recent, loading, ...found }));
});
