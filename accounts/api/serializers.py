from django.contrib.auth import get_user_model
from rest_framework import serializers

from core.strict import StrictInput

from ..roles import ROLES
from ..selectors import user_role


class UserSerializer(serializers.ModelSerializer):
    role = serializers.SerializerMethodField()

    class Meta:
        model = get_user_model()
        fields = ["username", "role", "is_active", "is_staff", "is_superuser", "date_joined", "last_login"]
        read_only_fields = fields

    def get_role(self, user) -> str | None:
        return user_role(user)


class UserCreateSerializer(StrictInput, serializers.Serializer):
    username = serializers.CharField(max_length=150)
    role = serializers.ChoiceField(choices=ROLES)
    password = serializers.CharField(required=False, write_only=True, trim_whitespace=False,
                                     help_text="omitted: one is generated and shown in the answer, once")


class UserCreatedSerializer(UserSerializer):
    password = serializers.CharField(required=False, help_text="the generated password, shown this once")

    class Meta(UserSerializer.Meta):
        fields = [*UserSerializer.Meta.fields, "password"]


class RoleSerializer(StrictInput, serializers.Serializer):
    role = serializers.ChoiceField(choices=ROLES)


class SuperuserSerializer(StrictInput, serializers.Serializer):
    superuser = serializers.BooleanField()


class TokenSerializer(serializers.Serializer):
    prefix = serializers.CharField(read_only=True)
    user = serializers.CharField(source="user.username", read_only=True)
    name = serializers.CharField(read_only=True)
    created_at = serializers.DateTimeField(read_only=True)
    last_used_at = serializers.DateTimeField(read_only=True, allow_null=True)
    expires_at = serializers.DateTimeField(read_only=True, allow_null=True)


class TokenCreateSerializer(StrictInput, serializers.Serializer):
    name = serializers.CharField(max_length=64, required=False, default="", allow_blank=True)
    days = serializers.FloatField(required=False, default=90.0, min_value=0.001, max_value=366,
                                  help_text="how long the token lives (default 90, at most 366); a token made "
                                            "with a token never outlives it")


class TokenCreatedSerializer(TokenSerializer):
    token = serializers.CharField(read_only=True, help_text="the token itself, shown this once")
