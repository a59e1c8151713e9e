"""Dashboard sign-in: a read token entered once, kept in an HttpOnly SameSite cookie.

A proxy in front of the server may instead send the token as `Authorization: Bearer ...`.
The cookie holds the token itself, so any replica can check it (the server keeps no
sessions) and a revoked token stops working within the token cache's TTL.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from urllib.parse import parse_qs, quote

import anyio.to_thread
from starlette.requests import HTTPConnection, Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

COOKIE = "stepscope_token"
COOKIE_MAX_AGE_S = 30 * 24 * 3600
SIGN_IN = "/sign-in"
SIGN_OUT = "/sign-out"
SCOPES = frozenset({"read", "admin"})
"""A dashboard token needs one of these scopes."""
_MAX_FORM_BYTES = 8192

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Sign in · stepscope</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; background: #f5f6f8; margin: 0; }}
main {{ max-width: 420px; margin: 12vh auto; background: #fff; padding: 2rem;
        border-radius: 8px; box-shadow: 0 1px 4px rgba(0,0,0,.12); }}
h1 {{ font-size: 1.3rem; margin-top: 0; }}
input[type=password] {{ width: 100%; padding: .55rem; margin: .4rem 0 1rem;
                        box-sizing: border-box; }}
button {{ padding: .5rem 1.2rem; }}
.error {{ color: #c62828; }}
.hint {{ color: #555; font-size: .9rem; }}
</style></head>
<body><main>
<h1>stepscope</h1>
<p class="hint">This server requires a token with the <code>read</code> scope
(create one with <code>stepscope token create --scope read</code>).</p>
{error}
<form method="post" action="{action}">
<label for="token">Token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required autofocus>
<input type="hidden" name="next" value="{next}">
<button type="submit">Sign in</button>
</form>
</main></body></html>
"""


def safe_next(target: str | None) -> str:
    """A local path to return to after signing in ('/' for anything else)."""
    if not target or not target.startswith("/") or target.startswith(("//", "/\\")):
        return "/"
    return target


def sign_in_url(next_path: str) -> str:
    """The sign-in page that returns to `next_path`."""
    return f"{SIGN_IN}?next={quote(safe_next(next_path), safe='/')}"


def page(next_path: str, error: str | None = None, status_code: int = 200) -> HTMLResponse:
    """The sign-in form (every interpolated string escaped)."""
    body = _PAGE.format(
        action=SIGN_IN,
        next=html.escape(safe_next(next_path)),
        error=f'<p class="error" role="alert">{html.escape(error)}</p>' if error else "",
    )
    return HTMLResponse(body, status_code=status_code, headers={"Cache-Control": "no-store"})


def presented_token(conn: HTTPConnection) -> str | None:
    """The token of a request: a proxy's bearer header first, else the cookie."""
    kind, _, token = conn.headers.get("authorization", "").partition(" ")
    if kind.lower() == "bearer" and token.strip():
        return token.strip()
    return conn.cookies.get(COOKIE) or None


TokenScopes = Callable[[str], frozenset[str] | None]
"""A bearer token's scopes; None for an unknown or revoked token."""


async def token_allows(token_scopes: TokenScopes, token: str | None) -> bool:
    """True when the token is known and has the read (or admin) scope."""
    if not token:
        return False
    scopes = await anyio.to_thread.run_sync(token_scopes, token)
    return scopes is not None and bool(scopes & SCOPES)


async def sign_in(request: Request, token_scopes: TokenScopes, *, auth: bool) -> Response:
    """GET: the form; POST: check the token and set the cookie, or say what was wrong."""
    if not auth:
        return RedirectResponse("/", status_code=303)
    if request.method != "POST":
        return page(request.query_params.get("next", "/"))
    body = await request.body()
    if len(body) > _MAX_FORM_BYTES:
        return page("/", "The form was too large.", status_code=413)
    form = parse_qs(body.decode("utf-8", "replace"))
    token = (form.get("token") or [""])[0].strip()
    target = safe_next((form.get("next") or ["/"])[0])
    if not await token_allows(token_scopes, token):
        return page(
            target,
            "That token is unknown, revoked, or lacks the read scope.",
            status_code=401,
        )
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        COOKIE,
        token,
        max_age=COOKIE_MAX_AGE_S,
        path="/",
        httponly=True,
        samesite="lax",
        secure=_https(request),
    )
    return response


def sign_out(request: Request) -> Response:
    """Forget the cookie and go back to the sign-in page."""
    response = RedirectResponse(SIGN_IN, status_code=303)
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="lax", secure=_https(request))
    return response


def _https(request: Request) -> bool:
    return request.url.scheme == "https"
