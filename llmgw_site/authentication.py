"""How operators authenticate to the REST API (a site-wide DRF setting)."""

from rest_framework import authentication, exceptions


class TokenAuthentication(authentication.TokenAuthentication):
    """An operator token as ``Authorization: Token <t>`` (DRF's spelling) or
    ``Authorization: Bearer <t>`` (what most APIs and the gateway take)."""

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
        return self.authenticate_credentials(token)
