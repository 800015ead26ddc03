from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from .. import selectors, services
from ..actors import actor
from .serializers import RoleSerializer, SuperuserSerializer, UserCreatedSerializer, UserCreateSerializer, UserSerializer


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
