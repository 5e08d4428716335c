// JupyterLab in headless Debian chromium: open the Magnitude panel, run a %%magnitude cell, see the
// streamed answer in the output and the panel's counters move. Saves screenshots for the README.
import assert from 'node:assert/strict';
import path from 'node:path';
import { inLab, labUrl, shots, token } from './lab.mjs';

const TIMEOUT = Number(process.env.UI_TIMEOUT_MS ?? 180_000);

await inLab(TIMEOUT, async page => {
  await page.goto(`${labUrl}lab/tree/demo.ipynb?token=${token}`);
  await page.waitForSelector('.jp-Notebook .jp-Cell');

  // The panel: its tab is in the left sidebar.
  await page.locator('.jp-SideBar [data-id="magnitude-panel"]').click();
  const panel = page.locator('#magnitude-panel');
  await panel.waitFor({ state: 'visible' });
  // JupyterLab starts without a model in memory: the panel says so, and its button loads it.
  await page.waitForFunction(
    () => /no model loaded yet/.test(document.querySelector('#magnitude-panel .mg-state')?.textContent ?? '')
  );
  await panel.locator('.mg-load-model').click();
  await page.waitForFunction(() => document.querySelector('#magnitude-panel .mg-state')?.textContent === 'ready');
  const tokensBefore = Number(await panel.locator('.mg-tokens').textContent());
  assert.equal(await panel.locator('.mg-model').textContent(), 'smollm2-135m');

  // Wait for the kernel, then run every cell from the Run menu.
  await page.waitForFunction(() => /\|\s*Idle/.test(document.querySelector('.jp-StatusBar-Widget')?.textContent ?? ''));
  await page.locator('.lm-MenuBar-itemLabel', { hasText: /^Run$/ }).click();
  await page.locator('.lm-Menu-itemLabel', { hasText: /^Run All Cells$/ }).click();

  // The answer streams into the second cell's output.
  const output = page.locator('.jp-Cell').nth(1).locator('.jp-OutputArea-output');
  await page.waitForFunction(
    () => (document.querySelectorAll('.jp-Cell')[1]?.querySelector('.jp-OutputArea-output')?.textContent ?? '').length > 20
  );
  await page.waitForFunction(
    () => /\[\d+\]/.test(document.querySelectorAll('.jp-Cell')[1]?.querySelector('.jp-InputPrompt')?.textContent ?? '')
  );
  const answer = (await output.first().textContent()) ?? '';
  assert.ok(answer.trim().length > 20, `streamed answer: ${answer}`);

  // The panel's counters moved: tokens generated went up, a finished request is listed.
  await page.waitForFunction(
    before => Number(document.querySelector('#magnitude-panel .mg-tokens')?.textContent) > before,
    tokensBefore
  );
  await panel.locator('.mg-recent .mg-request').first().waitFor();
  const recent = await panel.locator('.mg-recent .mg-request').first().textContent();
  assert.match(recent ?? '', /TTFT .* tokens/);
  const status = await page.locator('.mg-statusbar').textContent();
  assert.match(status ?? '', /tok\/s · KV \d+%/);
  // ... and where the engine thread's time went per step.
  await page.waitForFunction(() =>
    /ms llama_decode \(\d+\.\d rows\)/.test(document.querySelector('#magnitude-panel .mg-steps')?.textContent ?? '')
  );
  const steps = await panel.locator('.mg-steps').textContent();

  // Both resident models are listed with their memory; picking the second shows its engine.
  const second = process.env.SECOND_MODEL;
  const loaded = await fetch(`${labUrl}magnitude/models/${second}/load`, {
    method: 'POST',
    headers: { Authorization: `token ${token}` }
  });
  assert.equal(loaded.status, 200, await loaded.text());
  await page.waitForFunction(() => document.querySelectorAll('#magnitude-panel .mg-resident').length === 2);
  const residents = await panel.locator('.mg-resident').allTextContents();
  assert.ok(residents.some(line => line.startsWith(second) && /MiB/.test(line)), residents.join(' | '));
  await panel.locator('.mg-model-select').selectOption(second);
  await page.waitForFunction(
    name => document.querySelector('#magnitude-panel .mg-model')?.textContent === name,
    second
  );
  const shown = await panel.locator('.mg-model').textContent();
  await panel.locator('.mg-model-select').selectOption('');
  await page.waitForFunction(() => document.querySelector('#magnitude-panel .mg-model')?.textContent === 'smollm2-135m');

  if (shots) {
    // Decline JupyterLab's "news" question so that it does not cover the screenshot.
    await page.locator('.jp-toast-button', { hasText: /^No$/ }).click({ timeout: 2000 }).catch(() => {});
    await page.screenshot({ path: path.join(shots, 'jupyterlab-magnitude.png') });
    await panel.screenshot({ path: path.join(shots, 'magnitude-panel.png') });
  }
  console.log(
    JSON.stringify({
      ok: true,
      tokensBefore,
      answer: answer.slice(0, 80),
      recent,
      status,
      steps,
      residents: residents.length,
      shown
    })
  );
});
