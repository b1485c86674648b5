"""The startup check of the experiment tracker (wandb), before any process group exists.

`logging.wandb_mode: online` needs a login and the wandb server: without either, wandb's own failure takes 19 s (no
login: it retries, then a traceback on every rank) to 100 s (no network). `check_tracking` says it in one line within
~3 s instead. It reads what wandb reads (wandb 0.2x-0.3x): the API key from WANDB_API_KEY (or an identity token file,
WANDB_IDENTITY_TOKEN_FILE), else the netrc entry for the server's host (`wandb login` writes it; NETRC names another
file); the server from WANDB_BASE_URL, else the `base_url` of wandb's settings file (`wandb login --host` writes it),
else https://api.wandb.ai. Only a TCP connection is tried (no request, no credential sent), through the proxy when
one is set for the scheme. No credential is read beyond whether one exists, none is written.

Every rank runs it (in `parse_args`, the same inputs on every rank of a node), so every rank raises the same error.
"""

from __future__ import annotations

import configparser
import netrc
import os
import socket
import threading
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from train.config import Recipe
from train.errors import UserError

DEFAULT_BASE_URL = "https://api.wandb.ai"
CONNECT_TIMEOUT_S = 3.0  # name resolution and TCP connect together: a slow link still connects well within it
OFFLINE = "or set logging.wandb_mode: offline (upload later with `wandb sync <output_dir>/wandb/offline-run-*`)"


def check_tracking(recipe: Recipe) -> None:
    """Online wandb: a UserError when no API key is found or the wandb server cannot be reached; nothing otherwise."""
    if recipe.logging.wandb_mode != "online":
        return
    base_url, from_where = base_url_of()
    host = urlsplit(base_url).hostname
    if not host:
        raise UserError(f"the wandb server URL {base_url!r} ({from_where}) has no host: set it to the server's URL, "
                        "e.g. https://api.wandb.ai")  # fmt: skip
    if not has_api_key(base_url):
        raise UserError(f"logging.wandb_mode is online but no wandb login was found (no WANDB_API_KEY, no entry for "
                        f"{host} in {netrc_path()}): run `wandb login` or set WANDB_API_KEY, {OFFLINE}")  # fmt: skip
    problem = unreachable(base_url)
    if problem is not None:
        raise UserError(f"logging.wandb_mode is online but the wandb server {base_url} ({from_where}) cannot be "
                        f"reached: {problem}; check the network (or WANDB_BASE_URL), {OFFLINE}")  # fmt: skip


def base_url_of() -> tuple[str, str]:
    """The wandb server's URL and where it was set, as wandb resolves it."""
    if url := os.environ.get("WANDB_BASE_URL", "").strip():
        return url.rstrip("/"), "WANDB_BASE_URL"
    config_dir = os.environ.get("WANDB_CONFIG_DIR")
    settings = Path(config_dir) / "settings" if config_dir else Path("~/.config/wandb/settings").expanduser()
    parser = configparser.ConfigParser()
    try:
        parser.read(settings)
        url = parser.get("default", "base_url", fallback="").strip()
    except (configparser.Error, OSError, UnicodeDecodeError):  # wandb warns and ignores a broken settings file too
        url = ""
    return (url.rstrip("/"), f"base_url in {settings}") if url else (DEFAULT_BASE_URL, "wandb's default")


def netrc_path() -> Path:
    """The netrc file wandb reads (NETRC, else ~/.netrc)."""
    return Path(os.environ["NETRC"]).expanduser() if os.environ.get("NETRC") else Path("~/.netrc").expanduser()


def has_api_key(base_url: str) -> bool:
    """Whether wandb finds a credential for `base_url`: an empty WANDB_API_KEY counts as none."""
    if os.environ.get("WANDB_API_KEY", "").strip() or os.environ.get("WANDB_IDENTITY_TOKEN_FILE", "").strip():
        return True
    try:
        entry = netrc.netrc(str(netrc_path())).authenticators(urlsplit(base_url).netloc)
    except (OSError, netrc.NetrcParseError):  # no file, or one wandb cannot read either
        return False
    return bool(entry and entry[2])


def unreachable(base_url: str, timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why a TCP connection to the server (or its proxy) fails within `timeout` seconds; None when it connects. Run
    in a thread: socket timeouts do not bound name resolution, which can hang on a machine without DNS."""
    parts = urlsplit(base_url)
    host, port = parts.hostname or "", parts.port or (80 if parts.scheme == "http" else 443)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):  # wandb's requests go through it: so does this check
        p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = p.hostname or "", p.port or 80
    result: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(None)
        except OSError as e:
            result.append(f"{host}:{port}: {_why(e)}")

    thread = threading.Thread(target=connect, daemon=True)  # daemon: a hung resolver does not hold the exit
    thread.start()
    thread.join(timeout)
    return result[0] if result else f"{host}:{port}: no connection within {timeout:g} s"


def _why(e: OSError) -> str:
    if isinstance(e, socket.timeout):
        return f"no connection within {CONNECT_TIMEOUT_S:g} s"
    if isinstance(e, socket.gaierror):
        return f"the host name cannot be resolved ({e.strerror or e})"
    return (e.strerror or str(e)).lower()
