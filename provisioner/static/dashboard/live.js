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

  // Back from an action on a fleet row (…#row-ID): the keyboard goes on from that row's
  // link, not from the top of the page; a row gone (terminated): from the message saying so.
  function toRow() {
    var m = /^#row-([\w.-]+)$/.exec(location.hash);
    if (!m) return;
    var link = document.getElementById("row-" + m[1]); // the row's machine link
    var flash = document.getElementById("flash");
    if (link) link.focus();
    else if (flash) { flash.tabIndex = -1; flash.focus(); }
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", toRow);
  else toRow();

  // The Plan page: a file picked fills the box with its text (the page's own answer to
  // ?file=…), to read or edit; an edited box is what is planned, not the file. Without
  // JavaScript the picked file is planned and shown in the box after.
  function picker() {
    var pick = document.getElementById("plan-file");
    var box = document.getElementById("plan-text");
    if (!pick || !box) return;
    pick.addEventListener("change", function () {
      if (!pick.value) return;
      var u = new URL(location.href);
      u.search = "";
      u.hash = "";
      u.searchParams.set("file", pick.value);
      fetch(u, { credentials: "same-origin" })
        .then(function (r) { if (!r.ok) throw new Error(String(r.status)); return r.text(); })
        .then(function (html) {
          var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("plan-text");
          if (fresh) box.value = fresh.value;
        })
        .catch(function () {});
    });
    box.addEventListener("input", function () { pick.value = ""; });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", picker);
  else picker();

  window.provisionerRefresh = refresh; // for tests and the curious
  setInterval(refresh, EVERY);
})();
