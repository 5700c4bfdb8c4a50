// Every 30 s the page is fetched again and its live parts (elements with data-live and an id)
// are swapped in place: the scroll, the focus and a half-filled form stay as they are. Nothing
// is swapped while the reader is in a form or on a live part, or the tab is hidden. Without
// JavaScript the page shows when it was made and a Refresh link.
(function () {
  "use strict";
  var EVERY = 30000;

  function busy() {
    var el = document.activeElement;
    if (!el || el === document.body) return false;
    return !!(el.closest("form") || el.closest("[data-live]"));
  }

  function refresh() {
    if (document.hidden || busy()) return Promise.resolve(false);
    return fetch(location.href, { credentials: "same-origin" })
      .then(function (r) {
        if (!r.ok || r.redirected) throw new Error(String(r.status)); // e.g. signed out
        return r.text();
      })
      .then(function (html) {
        if (busy()) return false;
        var doc = new DOMParser().parseFromString(html, "text/html");
        document.querySelectorAll("[data-live][id]").forEach(function (old) {
          var fresh = doc.getElementById(old.id);
          if (fresh) old.replaceWith(document.importNode(fresh, true));
        });
        return true;
      })
      .catch(function () { return false; });
  }

  window.provisionerRefresh = refresh; // for tests and the curious
  setInterval(refresh, EVERY);
})();
