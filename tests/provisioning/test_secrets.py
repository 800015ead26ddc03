"""The token secret encrypted at rest under the PKI directory; the control
plane's SSH key 0600 under the data directory."""

import os
import stat

import pytest
from django.test import Client

from provisioning import services, sshkeys, vault
from provisioning.models import Hypervisor

from .pve import TOKEN_SECRET

pytestmark = pytest.mark.django_db


@pytest.fixture
def private_dirs(settings, tmp_path):
    settings.PKI_DIR = tmp_path / "pki"
    settings.DATA_DIR = tmp_path / "data"
    vault._fernet.cache_clear()
    yield settings
    vault._fernet.cache_clear()


def _row(**overrides):
    fields = dict(name="pve", url="https://127.0.0.1:8006", token_id="llmgw@pve!prov", token_secret=TOKEN_SECRET,
                  image="local:import/noble.qcow2")
    fields.update(overrides)
    return services.hypervisor_create(actor="tests", **fields)


def test_secret_is_encrypted_with_a_0600_key_file(private_dirs, monkeypatch):
    modes = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *args, **kwargs):
        if str(path).endswith(vault.KEY_FILE):
            modes.append((flags & os.O_EXCL, mode))
        return real_open(path, flags, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    row = _row()
    key_file = private_dirs.PKI_DIR / vault.KEY_FILE
    # Created 0600 from the start, exclusively, never chmodded afterwards.
    assert modes == [(os.O_EXCL, 0o600)]
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    stored = Hypervisor.objects.get(pk=row.pk).token_secret_encrypted
    assert TOKEN_SECRET not in stored
    assert vault.secret_decrypt(stored) == TOKEN_SECRET


def test_control_plane_ssh_key_is_0600_and_stable(private_dirs):
    public = sshkeys.control_plane_public_key()
    assert public.startswith("ssh-ed25519 ") and public.endswith(" llmgw-control-plane")
    path = private_dirs.DATA_DIR / "ssh" / "id_ed25519"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert sshkeys.control_plane_public_key() == public


def test_admin_never_shows_the_secret(private_dirs, admin_user):
    row = _row()
    client = Client()
    client.force_login(admin_user)
    page = client.get(f"/admin/provisioning/hypervisor/{row.pk}/change/").content.decode()
    assert TOKEN_SECRET not in page and row.token_secret_encrypted not in page
    assert TOKEN_SECRET not in client.get("/admin/provisioning/hypervisor/").content.decode()

    # Read-only there (tests/test_admin_pages.py): a post changes nothing.
    form = {"name": "pve", "url": "https://127.0.0.1:8006", "token_id": "llmgw@pve!prov", "token_secret": "new",
            "ca_pem": "", "node": "", "storage": "local-lvm", "image": "local:import/noble.qcow2",
            "bridge": "vmbr0", "pool": "", "ciuser": "ubuntu", "nameserver": "", "ssh_keys": ""}
    assert client.post(f"/admin/provisioning/hypervisor/{row.pk}/change/", form).status_code == 403
    assert vault.secret_decrypt(Hypervisor.objects.get(pk=row.pk).token_secret_encrypted) == TOKEN_SECRET
