from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from .. import selectors, services
from ..actors import actor
from ..models import OperatorToken
from .serializers import (RoleSerializer, SuperuserSerializer, TokenCreatedSerializer, TokenCreateSerializer,
                          TokenSerializer, UserCreatedSerializer, UserCreateSerializer, UserSerializer)


class UserViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Users and their roles (viewer, operator, admin)."""

    serializer_class = UserSerializer
    permission_model = "auth.user"
    required_permissions = {"set_role": ("auth.change_user",)}
    lookup_field = "username"
    lookup_value_regex = "[^/]+"

    def get_queryset(self):
        return selectors.user_list()

    @extend_schema(request=UserCreateSerializer, responses={201: UserCreatedSerializer})
    def create(self, request):
        serializer = UserCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        user, generated = services.user_create(actor=actor(request), **serializer.validated_data)
        data = UserSerializer(user).data
        if generated:
            data["password"] = generated
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(request=RoleSerializer, responses=UserSerializer)
    @action(detail=True, methods=["post"], url_path="set-role")
    def set_role(self, request, username=None):
        serializer = RoleSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        user = services.user_set_role(username=username, role=serializer.validated_data["role"], actor=actor(request))
        return Response(UserSerializer(user).data)

    # Mapped to no permission on purpose: only superusers may make superusers.
    @extend_schema(request=SuperuserSerializer, responses=UserSerializer)
    @action(detail=True, methods=["post"], url_path="set-superuser")
    def set_superuser(self, request, username=None):
        serializer = SuperuserSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        user = services.user_set_superuser(username=username, superuser=serializer.validated_data["superuser"],
                                           actor=actor(request))
        return Response(UserSerializer(user).data)


class TokenViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """Operator tokens: each acts as its user, with that user's role, until it
    expires. Everyone lists, makes and revokes their own; with
    ``accounts.delete_operatortoken`` (admins) anyone's."""

    serializer_class = TokenSerializer
    lookup_field = "prefix"
    lookup_value_regex = "[^/]+"
    # A user's own tokens need no permission beyond being a user; the views
    # scope what each sees and may revoke.
    required_permissions = {"list": (), "create": (), "destroy": ()}

    def get_queryset(self):
        everyone = self.request.user.has_perm("accounts.delete_operatortoken") and \
            self.request.query_params.get("all") in ("1", "true")
        return selectors.token_list(user=self.request.user, everyone=everyone)

    @extend_schema(request=TokenCreateSerializer, responses={201: TokenCreatedSerializer})
    def create(self, request):
        serializer = TokenCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        parent = request.auth if isinstance(request.auth, OperatorToken) else None
        created = services.token_create(user=request.user, name=serializer.validated_data["name"],
                                        days=serializer.validated_data["days"],
                                        not_after=parent.expires_at if parent else None, actor=actor(request))
        data = TokenSerializer(created.row).data
        data["token"] = created.token
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: TokenSerializer})
    def destroy(self, request, prefix=None):
        row = services.token_revoke(prefix=prefix, user=request.user, actor=actor(request))
        return Response({**TokenSerializer(row).data, "revoked": True})
