import factory
from django.utils import timezone

from core.models import Event
from nodes.choices import NodeStatus
from nodes.models import Fabric, Gpu, Hca, Node


class FabricFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Fabric
        django_get_or_create = ("name",)

    name = factory.Sequence(lambda n: f"ib-{n}")


class NodeFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Node
        django_get_or_create = ("name",)
        # The fabrics hook writes the m2m itself; no second save of the node.
        skip_postgeneration_save = True

    name = factory.Sequence(lambda n: f"node{n:02d}")
    status = NodeStatus.READY
    status_changed_at = factory.LazyFunction(timezone.now)
    last_heartbeat_at = factory.LazyFunction(timezone.now)
    mgmt_addr = "127.0.1.1"
    mgmt_interface = "lo"
    agent_version = "0.1.0"

    @factory.post_generation
    def fabrics(self, create, extracted, **kwargs):
        if create and extracted:
            self.fabrics.set([FabricFactory(name=f) if isinstance(f, str) else f for f in extracted])


class GpuFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Gpu

    node = factory.SubFactory(NodeFactory)
    index = factory.Sequence(lambda n: n % 8)
    uuid = factory.Sequence(lambda n: f"GPU-{n:08x}-0000-0000-0000-000000000000")
    name = "NVIDIA H200"
    memory_mib = 143771
    pci_bus_id = factory.Sequence(lambda n: f"00000000:{n % 256:02X}:00.0")


class HcaFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Hca

    node = factory.SubFactory(NodeFactory)
    name = factory.Sequence(lambda n: f"mlx5_{n}")
    fabric = factory.SubFactory(FabricFactory)
    state = "ACTIVE"
    link_layer = "InfiniBand"
    rate = "400 Gb/sec (4X NDR)"


class EventFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Event

    kind = "node.status"
    subject = "node/node01"
    message = "something happened"


def node_with_gpus(name: str, *, gpus: int = 8, fabric: str | None = None, hcas=("mlx5_0", "mlx5_1"), addr="127.0.1.1"):
    """A ready node with its GPUs and, when in a fabric, its HCAs."""
    node = NodeFactory(name=name, mgmt_addr=addr, fabrics=[fabric] if fabric else [])
    for i in range(gpus):
        GpuFactory(node=node, index=i, uuid=f"GPU-{name}-{i:02d}")
    if fabric:
        for hca in hcas:
            HcaFactory(node=node, name=hca, fabric=FabricFactory(name=fabric))
    return node


class CatalogEntryFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = "replicas.CatalogEntry"
        django_get_or_create = ("name",)

    name = factory.Sequence(lambda n: f"model-{n}")
    engine = "sim"
    weights = "/models/sim"
    nodes = 1
    gpus_per_node = 1
    replicas = 1
