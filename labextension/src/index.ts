import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Poll } from '@lumino/polling';

import {
  EngineStatus,
  chosenModel,
  openDocumentNamed,
  pushHistory,
  sloColor,
  statusLine,
  statusTooltip
} from './format';
import { MagnitudePanel, MagnitudeStatusItem } from './panel';

const POLL_MS = 1000;
const CALIBRATION_NOTEBOOK = '03_calibration.ipynb';

const icon = new LabIcon({
  name: 'magnitude-jupyter:icon',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><path class="jp-icon3" fill="#616161" ' +
    'd="M3 20h2V10H3v10zm4 0h2V4H7v16zm4 0h2v-7h-2v7zm4 0h2V8h-2v12zm4 0h2v-4h-2v4z"/></svg>'
});

/** GET/DELETE one of the extension's routes under `{base_url}magnitude/`, with Jupyter's auth. */
export async function requestAPI<T>(endPoint: string, init: RequestInit = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'magnitude', endPoint);
  const response = await ServerConnection.makeRequest(url, init, settings);
  const text = await response.text();
  const data = text ? JSON.parse(text) : null;
  if (!response.ok) {
    throw new ServerConnection.ResponseError(response, data?.error?.message ?? response.statusText);
  }
  return data as T;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'magnitude-jupyter:plugin',
  description: 'The Magnitude sidebar and status bar item: the local engine, live.',
  autoStart: true,
  requires: [ILabShell],
  optional: [ILayoutRestorer, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    shell: ILabShell,
    restorer: ILayoutRestorer | null,
    statusBar: IStatusBar | null
  ) => {
    const panel = new MagnitudePanel({
      openCalibration: async () => {
        // The notebook a participant has open already, wherever it lies; else the server copies the
        // workshop's (shipped in the package) into the Jupyter root once.
        const open = openDocumentNamed(shell.widgets('main'), CALIBRATION_NOTEBOOK);
        if (open) {
          shell.activateById(open);
          return;
        }
        const { path } = await requestAPI<{ path: string }>(`workshop/${CALIBRATION_NOTEBOOK}`, { method: 'POST' });
        await app.commands.execute('docmanager:open', { path });
      },
      cancel: id => void requestAPI(`v1/streams/${encodeURIComponent(id)}`, { method: 'DELETE' }),
      selectModel: id => {
        picked = id;
        history = [];
        void poll.refresh();
      },
      loadModel: async id => {
        await requestAPI(`models/${encodeURIComponent(id)}/load`, { method: 'POST' });
        void poll.refresh();
      }
    });
    panel.title.icon = icon;
    shell.add(panel, 'left', { rank: 900 });
    restorer?.add(panel, 'magnitude-panel');

    const item = new MagnitudeStatusItem(() => shell.activateById(panel.id));
    statusBar?.registerStatusItem('magnitude-jupyter:status', { item, align: 'left', rank: 100 });

    let history: number[] = [];
    let picked: string | null = null; // the resident model the panel shows; null: the default
    // JupyterLab's own poller: it backs off while the server fails and slows down while the page is hidden.
    const poll = new Poll({
      factory: async () => {
        try {
          const query = picked ? `?model=${encodeURIComponent(picked)}` : '';
          const status = await requestAPI<EngineStatus>(`status${query}`);
          picked = chosenModel(picked, status); // a model that was unloaded: back to the default
          history = pushHistory(history, status.recent_tokens_per_s);
          panel.render(status, history);
          item.setText(statusLine(status), sloColor(status), statusTooltip(status));
        } catch (reason) {
          panel.render(null, history, String((reason as Error).message ?? reason));
          item.setText(statusLine(null), null, statusTooltip(null));
          throw reason; // a rejection makes the Poll back off
        }
      },
      frequency: { interval: POLL_MS, backoff: true, max: 30 * POLL_MS },
      name: 'magnitude-jupyter:status',
      standby: 'when-hidden'
    });
    void poll.start();
  }
};

export default plugin;
