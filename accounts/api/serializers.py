from django.contrib.auth import get_user_model
from rest_framework import serializers

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


class UserCreateSerializer(serializers.Serializer):
    username = serializers.CharField(max_length=150)
    role = serializers.ChoiceField(choices=ROLES)
    password = serializers.CharField(required=False, write_only=True, trim_whitespace=False,
                                     help_text="omitted: one is generated and shown in the answer, once")


class UserCreatedSerializer(UserSerializer):
    password = serializers.CharField(required=False, help_text="the generated password, shown this once")

    class Meta(UserSerializer.Meta):
        fields = [*UserSerializer.Meta.fields, "password"]


class RoleSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=ROLES)


class SuperuserSerializer(serializers.Serializer):
    superuser = serializers.BooleanField()
