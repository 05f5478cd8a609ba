// FerryMQ web console: the only script (no CDN). Every page works without it; it adds an
// "auto-refresh" checkbox to the pages that only read (<body data-live>; never to the answer of a
// form's POST, which a reload would send again). The choice is remembered in this browser.
"use strict";
(function () {
  var main = document.querySelector("main");
  if (!main || !document.body.hasAttribute("data-live")) return;
  var label = document.createElement("label");
  label.className = "refresh";
  var box = document.createElement("input");
  box.type = "checkbox";
  box.checked = localStorage.getItem("ferrymq.refresh") === "1";
  label.appendChild(box);
  label.appendChild(document.createTextNode(" refresh every 5 s"));
  main.insertBefore(label, main.firstChild);
  var timer = null;
  function arm() {
    if (timer) clearTimeout(timer);
    timer = box.checked ? setTimeout(function () { location.reload(); }, 5000) : null;
  }
  box.addEventListener("change", function () {
    localStorage.setItem("ferrymq.refresh", box.checked ? "1" : "0");
    arm();
  });
  arm();
})();
