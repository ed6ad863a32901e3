// Loaded by every page with embedded Jupyter widgets, after require.js and before the widget
// manager (nb_ipywidgets_js in _config.yml). Two fixes for a site that loads nothing from outside:
(function () {
  // 1. RequireJS resolves the widget manager's modules, and the fonts its CSS loads, against
  //    baseUrl. Point it at this site's _static/ (the folder above this script's), so that they
  //    come from the site itself, whatever the page's depth, on any host or from disk.
  var src = document.currentScript.src;
  var staticRoot = src.slice(0, src.lastIndexOf("/site/") + 1);
  require.config({ baseUrl: staticRoot });
  // 2. The widget manager (@jupyter-widgets/base 1.x) typesets labels with MathJax 2's
  //    MathJax.Hub.Queue; the book loads MathJax 3, which has no Hub. Translate the call.
  document.addEventListener("DOMContentLoaded", function () {
    var MJ = window.MathJax;
    if (MJ && !MJ.Hub && MJ.startup) {
      MJ.Hub = {
        Queue: function (job) {
          var el = Array.isArray(job) ? job[2] : undefined;
          MJ.startup.promise.then(function () { return MJ.typesetPromise(el ? [el] : undefined); });
        }
      };
    }
  });
})();
