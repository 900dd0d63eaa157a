// saltserve console: draws the pages' charts (Chart.js) from their JSON data islands, opens the
// new-key dialog, and copies its key. Loaded from this origin only (the CSP refuses inline
// scripts and eval); htmx calls onLoad for the first page and for every swapped-in fragment.
(function () {
  "use strict";
  var COLORS = ["#1f6feb", "#d9480f", "#2f9e44", "#9c36b5", "#e8590c", "#0c8599", "#c2255c",
                "#5c940d", "#364fc7", "#862e9c"];

  function format(unit) {
    return function (value) { return value === null ? "—" : value + (unit === "%" ? "%" : unit ? " " + unit : ""); };
  }

  function draw(spec) {
    var canvas = document.getElementById(spec.id);
    if (!canvas || !window.Chart) { return; }
    var old = window.Chart.getChart(canvas);
    if (old) { old.destroy(); }
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

  function onLoad(root) {
    root.querySelectorAll("script.chart-data").forEach(function (island) {
      JSON.parse(island.textContent).forEach(draw);
    });
    root.querySelectorAll("dialog[data-open]").forEach(function (dialog) {
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
