"""SuperNode authentication keys: one ECDSA key pair per SuperNode, in the formats Flower reads.

``flower-supernode --auth-supernode-private-key`` loads an **OpenSSH private key** holding an EC key,
and ``flwr supernode register`` loads an **OpenSSH public key** on a NIST curve (Flower suggests P-384).
:func:`generate_node_keys` writes ``<name>`` (private, mode ``0600``) and ``<name>.pub`` into a ``0700`` folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .certificates import write_private
from .workdir import private_dir

__all__ = ["NodeKeys", "generate_node_keys"]


@dataclass(frozen=True)
class NodeKeys:
    """A SuperNode's key files: the private key stays on the node, the public key is registered with
    the SuperLink before the node starts."""

    private_key: Path
    public_key: Path


def generate_node_keys(directory: str | Path, name: str) -> NodeKeys:
    """Write a fresh P-384 key pair as ``directory/name`` (0600) and ``directory/name.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    d = private_dir(directory)
    key = ec.generate_private_key(ec.SECP384R1())
    keys = NodeKeys((d / name).resolve(), (d / f"{name}.pub").resolve())
    write_private(
        keys.private_key,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    keys.public_key.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n"
    )
    return keys
