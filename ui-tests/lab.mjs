// What every ui-test script shares: the lab it opens (LAB_URL, LAB_TOKEN), where screenshots go
// (SCREENSHOT_DIR), Debian's chromium, a 1440x900 page, and a picture of the page where a script fails.
import path from 'node:path';
import { chromium } from 'playwright-core';

export const labUrl = process.env.LAB_URL; // ends with '/'
export const token = process.env.LAB_TOKEN;
export const shots = process.env.SCREENSHOT_DIR;

/** Run `script(page)` on a new page with `timeoutMs` as its default timeout; the browser closes after. */
export async function inLab(timeoutMs, script) {
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
           '--disable-component-update', '--disable-sync', '--disable-dev-shm-usage']
  });
  const page = await browser.newPage({ viewport: { width: 1440, height: 900 } });
  page.setDefaultTimeout(timeoutMs);
  try {
    return await script(page);
  } catch (error) {
    // Leave a picture of what the browser showed when it failed.
    if (shots) await page.screenshot({ path: path.join(shots, 'failure.png') }).catch(() => {});
    throw error;
  } finally {
    await browser.close();
  }
}
