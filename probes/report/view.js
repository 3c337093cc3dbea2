// fbt-probe view: draws FBT_DATA (probes/report/view.py) into #controls and #app. No libraries.
(function () {
  const D = FBT_DATA, app = document.getElementById('app'), ctl = document.getElementById('controls');
  const state = {ex: 0, pass: D.passes > 1 ? 1 : 0, layer: 0, head: 0, query: null, target: null};
  const esc = s => String(s).replace(/[&<>"']/g, c => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;'}[c]));
  // cividis at five stops, as probes/common/html.py colours the report's heatmaps
  const STOPS = [[0, [0, 32, 77]], [0.25, [65, 77, 107]], [0.5, [124, 123, 120]], [0.75, [188, 175, 111]], [1, [255, 234, 70]]];
  function colour(t) {
    t = Math.max(0, Math.min(1, t || 0));
    for (let i = 1; i < STOPS.length; i++) {
      if (t <= STOPS[i][0]) {
        const [a, ca] = STOPS[i - 1], [b, cb] = STOPS[i], f = (t - a) / (b - a);
        const c = ca.map((u, j) => Math.round(u + f * (cb[j] - u)));
        const light = 0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2] > 140;
        return [`rgb(${c.join(',')})`, light ? '#000' : '#fff'];
      }
    }
  }
  function select(label, id, options, value, on) {
    const opts = options.map(([v, t]) => `<option value="${v}"${v == value ? ' selected' : ''}>${esc(t)}</option>`).join('');
    return `<label>${label} <select id="${id}">${opts}</select></label>`;
  }
  function range(n) { return [...Array(n).keys()]; }
  // attention weights: one character each (probes/report/view.py encode_weights)
  const LEVEL = {}; [...D.alphabet].forEach((c, i) => { LEVEL[c] = i / (D.alphabet.length - 1); });
  const weight = (s, k) => LEVEL[s[k]];

  function controls() {
    const ex = D.examples[state.ex];
    const targets = Object.keys(ex.probe[state.pass] ? ex.probe[state.pass].targets : {});
    if (!targets.includes(state.target)) state.target = targets[0] || null;
    let h = select('example', 'c-ex', D.examples.map((e, i) => [i, `row ${e.row} (${e.distractors} distractors)`]), state.ex);
    h += select('pass', 'c-pass', range(D.passes).map(k => [k, `pass ${k + 1}`]), state.pass);
    if (targets.length > 1) h += select('target', 'c-target', targets.map(t => [t, t]), state.target);
    if (D.heads) {
      h += select('layer', 'c-layer', range(D.layers).map(l => [l, `layer ${l}`]), state.layer);
      h += select('head', 'c-head', range(D.heads).map(k => [k, `head ${k}`]), state.head);
    }
    ctl.innerHTML = h;
    const bind = (id, key, num = true) => {
      const el = document.getElementById(id);
      if (el) el.addEventListener('change', () => { state[key] = num ? +el.value : el.value; if (key === 'ex') state.query = null; draw(); });
    };
    bind('c-ex', 'ex'); bind('c-pass', 'pass'); bind('c-target', 'target', false); bind('c-layer', 'layer'); bind('c-head', 'head');
  }

  function tokens(ex) {
    const q = state.query === null ? ex.colon : state.query;
    const row = D.heads ? attnRow(ex, q) : null;
    const spans = ex.tokens.map((t, i) => {
      let style = '';
      if (row && i <= q) { const [bg, fg] = colour(row[i]); style = ` style="background:${bg};color:${fg}"`; }
      const tip = `position ${i}: ${t}` + (row && i <= q ? `\nattention from ${q}: ${row[i].toFixed(2)}` : '') + (i === ex.colon ? '\n(the colon: the answer is read here)' : '');
      return `<span data-pos="${i}" class="${i === q ? 'sel' : ''}"${style} data-tip="${esc(tip)}">${esc(t)}</span>`;
    }).join('');
    return `<h2>Tokens</h2><p>Answer: <code>${esc(ex.labels.join(' '))}</code>. Click a token to see where it attends (layer ${state.layer}, head ${state.head}, pass ${state.pass + 1}); the outlined one is the query.</p><div class="tokens" id="tokens">${spans}</div>`;
  }

  function attnRow(ex, q) {
    const tri = ex.attention[state.pass][state.layer][state.head];
    const start = q * (q + 1) / 2;
    return [...tri.slice(start, start + q + 1)].map(c => LEVEL[c]);
  }

  function grid(id, title, rowNames, ex, cellOf, note) {
    const n = ex.tokens.length;
    let h = `<h2>${title}</h2>${note ? `<p>${note}</p>` : ''}<div style="overflow-x:auto"><table class="heat" id="${id}"><thead><tr><th></th>`;
    h += ex.tokens.map((t, i) => `<th data-tip="position ${i}">${esc(t)}</th>`).join('') + '</tr></thead><tbody>';
    rowNames.forEach((name, r) => {
      h += `<tr><th>${esc(name)}</th>`;
      for (let i = 0; i < n; i++) {
        const c = cellOf(r, i);
        if (!c) { h += '<td></td>'; continue; }
        const [bg, fg] = colour(c.v);
        h += `<td class="cell" style="background:${bg};color:${fg}" data-tip="${esc(c.tip)}">${esc(c.text)}</td>`;
      }
      h += '</tr>';
    });
    return h + '</tbody></table></div>';
  }

  function probePanel(ex) {
    const p = ex.probe[state.pass];
    if (!p || !state.target) return `<h2>Probe predictions</h2><p id="probe-note">${esc(D.probe_note)}</p>`;
    const rows = p.targets[state.target], ti = Object.keys(p.targets).indexOf(state.target);
    const truth = ex.labels[Math.max(0, ti)];
    const names = rows.map((_, d) => `depth ${d}`);
    return grid('probe', `Probe predictions, pass ${state.pass + 1} (${p.prefill}-prefill probes, target ${esc(state.target)})`, names, ex,
      (d, i) => rows[d] ? {v: rows[d][i] === truth ? 1 : 0, text: rows[d][i], tip: `depth ${d}, position ${i} (${ex.tokens[i]})\nthe probe says ${rows[d][i]}; the answer is ${truth}`} : null,
      `Bright: the probe names the answer (${esc(truth)}). Fitted at the colon only (position ${ex.colon}); elsewhere it shows what a reader trained there would say. ${esc(D.probe_note)}.`);
  }

  function lensPanel(ex) {
    const rows = ex.lens[state.pass];
    return grid('lens', `Lens, pass ${state.pass + 1}`, rows.map(r => r.name), ex,
      (r, i) => { const [w, p, top] = rows[r].cells[i]; return {v: p, text: w, tip: `${rows[r].name}, position ${i} (${ex.tokens[i]})\n${top}`}; },
      'Each cell: the top token of the head applied there, brightness its probability. fed_state reads the fed-back state h<sub>t-1</sub> through the head, fed_value the fusion\'s value W<sub>U</sub> h<sub>t-1</sub> (from pass 2 on); "tuned d" rows read depth d through the tuned lens. ' + esc(D.lens_note) + '.');
  }

  function attentionPanel(ex) {
    if (!D.heads) return '<h2>Attention</h2><p>This model has no per-head attention hooks.</p>';
    const n = ex.tokens.length, cell = Math.max(4, Math.min(16, Math.floor(640 / n)));
    return `<h2>Attention pattern, pass ${state.pass + 1}, layer ${state.layer}, head ${state.head}</h2><p>Rows: query positions; columns: keys. Hover for the weight; click a row to pick the query.</p><canvas id="attn" width="${n * cell}" height="${n * cell}" data-cell="${cell}" style="border:1px solid #ccc"></canvas>`;
  }

  function paintAttention(ex) {
    const cv = document.getElementById('attn');
    if (!cv) return;
    const g = cv.getContext('2d'), cell = +cv.dataset.cell, tri = ex.attention[state.pass][state.layer][state.head];
    let k = 0;
    for (let q = 0; q < ex.tokens.length; q++) {
      for (let j = 0; j <= q; j++, k++) { g.fillStyle = colour(weight(tri, k))[0]; g.fillRect(j * cell, q * cell, cell, cell); }
    }
    const tip = document.getElementById('tip');
    const at = e => { const r = cv.getBoundingClientRect(); return [Math.floor((e.clientY - r.top) / cell), Math.floor((e.clientX - r.left) / cell)]; };
    cv.addEventListener('mousemove', e => {
      const [q, j] = at(e);
      if (q < 0 || j < 0 || q >= ex.tokens.length || j > q) { tip.style.display = 'none'; return; }
      tip.textContent = `query ${q} (${ex.tokens[q]}) -> key ${j} (${ex.tokens[j]}): ${weight(tri, q * (q + 1) / 2 + j).toFixed(2)}`;
      tip.style.display = 'block';
    });
    cv.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
    cv.addEventListener('click', e => { state.query = at(e)[0]; draw(); });
  }

  function draw() {
    controls();
    const ex = D.examples[state.ex];
    app.innerHTML = tokens(ex) + probePanel(ex) + lensPanel(ex) + attentionPanel(ex);
    document.querySelectorAll('#tokens span').forEach(s => s.addEventListener('click', () => { state.query = +s.dataset.pos; draw(); }));
    if (D.heads) paintAttention(ex);
  }
  draw();
})();
