// The calibration widget in JupyterLab: it fits the cell, and after a page reload (kernel still
// running) it comes back with the data it had, as a plain ipywidget does, and its Start still runs a
// sweep. Saves a screenshot.
import assert from 'node:assert/strict';
import path from 'node:path';
import { inLab, labUrl, shots, token } from './lab.mjs';

// Every plotly plot on the page: its width and the number of points of each trace.
const plots = page => page.evaluate(() => [...document.querySelectorAll('.js-plotly-plot')].map(e => ({
  width: e.getBoundingClientRect().width,
  points: (e.data || []).map(t => (t.x || []).length)
})));

/** Reload the page, wait for the three plots, and give the cells that show a widget-restore error. */
async function reloadAndFindUnrestored(page) {
  await page.reload();
  await page.waitForSelector('.jp-Notebook .jp-Cell');
  await page.waitForFunction(() => document.querySelectorAll('.js-plotly-plot').length >= 3);
  await page.waitForTimeout(2000);
  return page.evaluate(() => [...document.querySelectorAll('.jp-Cell')]
    .map((cell, index) => (/Error displaying widget|model not found/i.test(cell.textContent) ? index : -1))
    .filter(index => index >= 0));
}

await inLab(Number(process.env.UI_TIMEOUT_MS ?? 180_000), async page => {
  const problems = [];
  const logged = []; // the page's warnings and errors, for the message of a failed restore
  page.on('console', m => {
    if (/Failed to initialize model|model not found/i.test(m.text())) problems.push(m.text());
    if (m.type() === 'error' || m.type() === 'warning') logged.push(`${m.type()}: ${m.text().slice(0, 300)}`);
  });
  await page.goto(`${labUrl}lab/tree/widget.ipynb?token=${token}`);
  await page.waitForSelector('.jp-Notebook .jp-Cell');
  await page.waitForFunction(() => /\|\s*Idle/.test(document.querySelector('.jp-StatusBar-Widget')?.textContent ?? ''));
  await page.locator('.lm-MenuBar-itemLabel', { hasText: /^Run$/ }).click();
  await page.locator('.lm-Menu-itemLabel', { hasText: /^Run All Cells$/ }).click();
  // The sweep (--start) runs to its end: the status says done.
  await page.waitForFunction(() => /done: \d+ levels/.test(document.querySelectorAll('.jp-Cell')[1]?.querySelector('.jp-OutputArea')?.textContent ?? ''));
  await page.waitForTimeout(1000);
  const cell = await page.evaluate(() => document.querySelectorAll('.jp-Cell')[1].querySelector('.jp-OutputArea-output').getBoundingClientRect().width);
  const before = await plots(page);
  const [throughput, latency, capacity] = before;
  assert.ok(throughput.points[0] === 2 && latency.points[0] === 2, JSON.stringify(before));
  for (const plot of [throughput, latency, capacity]) {
    assert.ok(plot.width <= cell, `a plot of ${plot.width} px in a ${cell} px cell`);
  }
  assert.ok(throughput.width + latency.width <= cell, 'throughput and TTFT side by side in a wide cell');
  // The plot says what one point measured, and the summary names the knee or says it was not reached.
  const caption = await page.evaluate(() => document.querySelector('.js-plotly-plot .gtitle')?.textContent ?? '');
  assert.match(caption, /each point: 2 requests, 8 new tokens each/);
  const outputText = await page.evaluate(() => document.querySelectorAll('.jp-Cell')[1].querySelector('.jp-OutputArea').textContent);
  assert.match(outputText, /knee (at \d+|not reached \(still rising at concurrency 2: try higher\))/);
  await page.locator('.lm-MenuBar-itemLabel', { hasText: /^File$/ }).click();
  await page.locator('.lm-Menu-itemLabel', { hasText: /^Save Notebook$/ }).click();
  await page.waitForFunction(() => !document.querySelector('.jp-mod-current.jp-mod-dirty, .lm-TabBar-tab.jp-mod-dirty'));
  await page.waitForTimeout(1000);

  // jupyterlab-manager's own restore now and then loses one model on a busy machine (seen only on the
  // plain IntSlider, its state in the kernel's reply): a widget missing after one reload is reloaded
  // once more, and one missing after that fails the test (docs/development.md, "Tests").
  const firstTry = await reloadAndFindUnrestored(page);
  if (firstTry.length) {
    console.error(`widgets not restored after the first reload, in cells ${firstTry}: ${JSON.stringify(logged.slice(-5))}`);
    problems.length = 0;
    logged.length = 0;
  }
  const unrestored = firstTry.length ? await reloadAndFindUnrestored(page) : firstTry;
  const after = await plots(page);
  assert.deepEqual(unrestored, [], `every widget is restored: ${JSON.stringify(logged.slice(-10))}`);
  assert.deepEqual(after.slice(0, 3).map(p => p.points), before.slice(0, 3).map(p => p.points), 'the plots keep their data');
  assert.deepEqual(problems, []);
  // Still live after the reload: Start runs the sweep again, and the verdict compares it with the first run.
  await page.locator('.jp-OutputArea button', { hasText: /^Start$/ }).first().click();
  await page.waitForFunction(
    () => /run 1/.test(document.querySelectorAll('.jp-Cell')[1]?.querySelector('.jp-OutputArea')?.textContent ?? ''),
    null,
    { timeout: 120_000 }
  );
  if (shots) {
    await page.locator('.jp-toast-button', { hasText: /^No$/ }).click({ timeout: 2000 }).catch(() => {});
    await page.locator('.jp-Cell').nth(1).screenshot({ path: path.join(shots, 'calibration-widget.png') });
  }
  console.log(JSON.stringify({ ok: true, cell, before, after, reloads: firstTry.length ? 2 : 1 }));
});
