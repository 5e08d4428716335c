// The pressure map in the calibration widget: `%magnitude calibrate --pressure-map ... --start` fills
// two heatmaps (tokens/s, p95 end-to-end) cell by cell, and the verdict reads the map. Saves a screenshot.
import assert from 'node:assert/strict';
import path from 'node:path';
import { inLab, labUrl, shots, token } from './lab.mjs';

await inLab(Number(process.env.UI_TIMEOUT_MS ?? 180_000), async page => {
  // A workspace of its own: the widget test's notebook stays closed (its cells would share the page's).
  await page.goto(`${labUrl}lab/workspaces/pressure/tree/pressure.ipynb?reset&token=${token}`);
  await page.waitForSelector('.jp-Notebook .jp-Cell');
  await page.locator('.jp-Dialog button', { hasText: /^Select$/ }).click({ timeout: 5000 }).catch(() => {});
  await page.waitForFunction(() => /\|\s*Idle/.test(document.querySelector('.jp-StatusBar-Widget')?.textContent ?? ''));
  await page.locator('.lm-MenuBar-itemLabel', { hasText: /^Run$/ }).click();
  await page.locator('.lm-Menu-itemLabel', { hasText: /^Run All Cells$/ }).click();
  const output = () => document.querySelectorAll('.jp-Cell')[1]?.querySelector('.jp-OutputArea')?.textContent ?? '';
  await page.waitForFunction(() => /done: \d+ cells measured/.test(
    document.querySelectorAll('.jp-Cell')[1]?.querySelector('.jp-OutputArea')?.textContent ?? ''));
  await page.waitForTimeout(1000);
  // Each heatmap as the browser drew it: plotly's trace (every cell's value) and the picture of its cells.
  const maps = await page.evaluate(() => [...document.querySelectorAll('.js-plotly-plot')]
    .filter(e => (e.data || []).some(t => t.type === 'heatmap'))
    .map(e => ({
      title: e.querySelector('.gtitle')?.textContent ?? '',
      z: e.data[0].z,
      drawn: e.querySelectorAll('.heatmaplayer image').length,
      width: e.getBoundingClientRect().width
    })));
  assert.equal(maps.length, 2, JSON.stringify(maps));
  assert.match(maps[0].title, /Output tokens\/s over concurrency × context/);
  assert.match(maps[1].title, /End-to-end p95/);
  for (const map of maps) {
    assert.equal(map.drawn, 1, 'the heatmap is drawn');
    assert.equal(map.z.flat().filter(v => typeof v === 'number' && v > 0).length, 4, JSON.stringify(map.z));
  }
  const text = await page.evaluate(output);
  assert.match(text, /at 256 tokens of context, (at most \d+ sessions? meets? p95|no number of sessions tested meets)/);
  if (shots) {
    await page.locator('.jp-toast-button', { hasText: /^No$/ }).click({ timeout: 2000 }).catch(() => {});
    await page.locator('.jp-Cell').nth(1).screenshot({ path: path.join(shots, 'pressure-map.png') });
  }
  console.log(JSON.stringify({ ok: true, maps }));
});
