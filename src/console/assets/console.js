// The console's own script: show every <time datetime> in the browser's time zone (the server
// writes UTC, which is what a page shows without JavaScript), also in parts htmx swaps in.
(function () {
  function localise(root) {
    root.querySelectorAll("time[datetime]").forEach(function (t) {
      var at = new Date(t.getAttribute("datetime"));
      if (!isNaN(at)) {
        t.title = t.textContent;
        t.textContent = at.toLocaleString();
      }
    });
  }
  document.addEventListener("DOMContentLoaded", function () { localise(document); });
  document.addEventListener("htmx:afterSwap", function (e) { localise(e.target); });
})();
