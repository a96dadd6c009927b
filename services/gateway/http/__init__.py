"""The gateway's HTTP front door: OpenAI-compatible chat completions and the status page.

``server.start_http`` runs it beside the gRPC servers (``services/gateway/server.py``);
``app.py`` has the routes, ``convert.py`` / ``replies.py`` translate between OpenAI JSON and the
gateway's protos, ``bridge.py`` / ``responses.py`` carry a request between the event loop and
the gateway's blocking front door, ``dashboard.py`` samples what ``/dashboard`` shows and
``static/`` holds the page itself.
"""
