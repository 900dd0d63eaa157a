// saltserve console: draws the pages' charts (Chart.js) from their canvases' data-chart specs, opens the
// new-key dialog, and copies its key. Loaded from this origin only (the CSP refuses inline
// scripts and eval); htmx calls onLoad for the first page and for every swapped-in fragment.
(function () {
  "use strict";
  var COLORS = ["#1f6feb", "#d9480f", "#2f9e44", "#9c36b5", "#e8590c", "#0c8599", "#c2255c",
                "#5c940d", "#364fc7", "#862e9c"];

  function format(unit) {
    return function (value) { return value === null ? "—" : value + (unit === "%" ? "%" : unit ? " " + unit : ""); };
  }

  function draw(canvas) {
    if (!window.Chart) { return; }
    var spec = JSON.parse(canvas.getAttribute("data-chart"));
    var line = spec.type === "line";
    var datasets = spec.datasets.map(function (d, i) {
      var color = COLORS[i % COLORS.length];
      return {label: d.label, data: d.data, borderColor: color, spanGaps: false,
              backgroundColor: line ? color : color + "cc", pointRadius: line ? 1.5 : 0,
              borderWidth: line ? 2 : 0};
    });
    var yTicks = {callback: format(spec.unit)};
    if (spec.unit === "%") { yTicks.max = 100; }
    new window.Chart(canvas, {
      type: spec.type,
      data: {labels: spec.labels, datasets: datasets},
      options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        plugins: {legend: {display: datasets.length > 1},
                  tooltip: {callbacks: {label: function (ctx) {
                    return ctx.dataset.label + ": " + format(spec.unit)(ctx.parsed.y);
                  }}}},
        scales: {x: {stacked: spec.stacked, ticks: {maxTicksLimit: 12}},
                 y: {stacked: spec.stacked, beginAtZero: true,
                     max: spec.unit === "%" ? 100 : undefined, ticks: yTicks}}
      }
    });
  }

  function within(root, selector) {  // root itself (htmx loads each swapped element) or below
    var found = Array.prototype.slice.call(root.querySelectorAll(selector));
    return root.matches && root.matches(selector) ? [root].concat(found) : found;
  }

  function onLoad(root) {
    if (window.Chart) {  // charts whose canvas a swap removed: free them (live pages poll)
      Object.values(window.Chart.instances).forEach(function (chart) {
        if (!chart.canvas || !chart.canvas.isConnected) { chart.destroy(); }
      });
    }
    within(root, "canvas[data-chart]").forEach(draw);
    within(root, "dialog[data-open]").forEach(function (dialog) {
      dialog.removeAttribute("data-open");
      // The key leaves the page when the dialog closes: it is shown once.
      dialog.addEventListener("close", function () { dialog.remove(); });
      dialog.showModal();
    });
  }

  document.addEventListener("click", function (event) {
    var button = event.target.closest("button[data-copy]");
    if (!button) { return; }
    var input = document.getElementById(button.getAttribute("data-copy"));
    var status = button.closest("dialog").querySelector(".copy-status");
    input.select();
    var done = function () { status.textContent = "Copied to the clipboard."; };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(input.value).then(done, function () {
        status.textContent = "Select the key and copy it (Ctrl+C).";
      });
    } else {
      status.textContent = document.execCommand("copy") ? "Copied to the clipboard."
                                                         : "Select the key and copy it (Ctrl+C).";
    }
  });

  document.addEventListener("DOMContentLoaded", function () {
    if (window.htmx) { window.htmx.onLoad(onLoad); } else { onLoad(document.body); }
  });
})();
