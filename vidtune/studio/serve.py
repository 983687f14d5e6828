"""`vidtune studio`: serve the studio over a root folder with uvicorn, on this machine only unless asked."""

from __future__ import annotations

from pathlib import Path

from vidtune.errors import VidtuneError
from vidtune.studio.security import is_loopback, new_token


def serve(root: str, host: str = "127.0.0.1", port: int = 8765, token: str | None = None) -> int:
    try:
        import uvicorn

        from vidtune.studio.app import create_app
    except ImportError as error:
        raise VidtuneError(f"vidtune studio needs its extra packages ({error.name} is missing).\nWhat to do: "
                           "pip install \"vidtune[studio]\".") from None
    if not is_loopback(host) and not token:
        token = new_token()
        print(f"--host {host} lets other machines reach the studio, so it needs a token; generated one: {token}")
    app = create_app(Path(root), token=token, host=host)
    shown = f"[{host}]" if ":" in host else host
    address = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    print(f"vidtune studio on {Path(root).resolve()}\nOpen {address} in a browser (Ctrl-C stops the studio; runs it "
          "started are stopped with a checkpoint).", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0
