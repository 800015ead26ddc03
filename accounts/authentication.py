"""How operators authenticate to the REST API (a site-wide DRF setting)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from .selectors import token_use


class TokenAuthentication(authentication.BaseAuthentication):
    """An operator token (``accounts.OperatorToken``, kept as a hash) as
    ``Authorization: Token <t>`` (DRF's spelling) or ``Authorization: Bearer <t>``
    (what most APIs and the gateway take)."""

    keywords = ("token", "bearer")

    def authenticate(self, request):
        auth = authentication.get_authorization_header(request).split()
        if not auth or auth[0].lower().decode("latin-1") not in self.keywords:
            return None
        if len(auth) != 2:
            raise exceptions.AuthenticationFailed(
                "Authorization header must be 'Token <token>' or 'Bearer <token>', with no spaces in the token"
            )
        try:
            token = auth[1].decode()
        except UnicodeError:
            raise exceptions.AuthenticationFailed("the token holds characters a token never has") from None
        row = token_use(token=token)
        if row is None:
            raise exceptions.AuthenticationFailed("Invalid token. It is unknown, revoked or expired.")
        # request.auth: the token's row (its expiry bounds the tokens it may make).
        return row.user, row

    def authenticate_header(self, request) -> str:
        return "Token"


class TokenScheme(OpenApiAuthenticationExtension):
    """The token in the OpenAPI document (registered by being defined)."""

    target_class = TokenAuthentication
    name = "tokenAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "header", "name": "Authorization",
                "description": "An operator token, as 'Token <token>' or 'Bearer <token>'."}
