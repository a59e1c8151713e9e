/* Start loading plotly.js with the page, not once a page's layout has arrived.
 *
 * dcc.Graph fetches plotly.js when the first graph mounts, so the browser idles while the
 * server builds a page's figures (~0.5 s for a large job) and only then parses plotly.js
 * (~1 s). Loaded here, the two overlap. Until the script has run, window.Plotly is a promise
 * of it: dcc.Graph waits on `Promise.resolve(window.Plotly || <its own loader>)`, and
 * plotly.js replaces window.Plotly with itself when it runs.
 *
 * dcc.Graph's lazy chunk is preloaded too: dcc fetches it when the first graph renders,
 * which on a large page comes after plotly.js has run (the page's layout waits for the main
 * thread), a round trip more before the first graph draws.
 */
(function () {
    var config = JSON.parse(document.getElementById("_dash-config").textContent);
    if (window.Plotly || window.location.pathname === config.requests_pathname_prefix) {
        return; // the jobs list draws no graph
    }
    var script = document.createElement("script");
    script.src = config.serve_locally
        ? config.requests_pathname_prefix + "_dash-component-suites/plotly/package_data/plotly.min.js"
        : config.plotlyjs_url;
    script.async = true;
    window.Plotly = new Promise(function (resolve, reject) {
        script.onload = function () { resolve(window.Plotly); };
        script.onerror = reject;
    });
    document.head.appendChild(script);
    if (config.serve_locally) {
        var chunk = document.createElement("link");
        chunk.rel = "preload";
        chunk.as = "script";
        chunk.href = config.requests_pathname_prefix + "_dash-component-suites/dash/dcc/async-graph.js";
        document.head.appendChild(chunk);
    }
})();
