"""`vidtune studio`: a local web app over the same library and commands as the command line.

`security.py` (the root every path stays under, the access token, cross-site protection), `clips.py` (the clip
cards and their captions), `form.py` (the settings form generated from the config schema), `planner.py` (the
memory planner's answer), `runs.py` (run folders read as the command line leaves them), `jobs.py` (the queue of
`vidtune` processes), `charts.py` (inline SVG curves), `web.py` (what the pages share), `runs_routes.py`,
`clips_routes.py`, `settings_routes.py` (each page's routes and actions), `app.py` (the app and the guard every
request passes), `serve.py` (the command).
"""
