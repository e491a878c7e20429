"""The live dashboard: ``GET /dashboard`` (a page and its server-sent events) and ``top``.

* :mod:`.feed`: one snapshot a second from the gateway's own state;
* :mod:`.routes`: the HTTP routes (:func:`add_dashboard_routes`), the page's
  assets in ``static/`` (hand-written JS and CSS, SVG charts, no CDN);
* :mod:`.top`: ``prefixrouter top``, the same view in a terminal.
"""

from prefixrouter.gateway.dashboard.routes import (
    DASHBOARD_PATH,
    add_dashboard_routes,
    dashboard_url,
)

__all__ = ["DASHBOARD_PATH", "add_dashboard_routes", "dashboard_url"]
