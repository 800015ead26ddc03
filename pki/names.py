"""The node id: one string that is VM name, hostname, node id and certificate CN."""

from agent.protocol import NODE_ID_RE


class InvalidNodeId(ValueError):
    pass


def validate_node_id(node_id: str) -> str:
    if not isinstance(node_id, str) or not NODE_ID_RE.match(node_id):
        raise InvalidNodeId(
            f"{node_id!r} is not a valid node id: use the node's hostname, 1-63 "
            "lowercase letters, digits, '-' or '.', starting and ending with a "
            "letter or digit (it is also the VM name and the certificate CN)"
        )
    return node_id
