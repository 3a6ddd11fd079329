"""Secure deployment of the local Flower federation: TLS and SuperNode authentication by default.

* the one full federation run of the suite (SuperLink + 2 SuperNodes over TLS, nodes authenticated)
  gives the in-process runner's global adapter and leaves no process behind;
* the SuperLink speaks only TLS, with a certificate for 127.0.0.1 from the generated CA: plain HTTP
  and an ``--insecure`` SuperNode are refused;
* a SuperNode whose public key was not registered is refused, and joins once it is registered;
* without processes: ``insecure=True`` gives the old command lines and warns, private keys are 0600,
  the certificate's SANs and chain are right.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import stat
import time
import warnings

import pytest
import torch

pytest.importorskip("cryptography")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from peft_lalora.federated.launcher import run as flower_run  # noqa: E402
from peft_lalora.federated.launcher.certificates import TLSConfig, generate_tls, write_private  # noqa: E402
from peft_lalora.federated.launcher.launcher import INSECURE_WARNING, LocalFederation  # noqa: E402
from peft_lalora.federated.launcher.node_keys import generate_node_keys  # noqa: E402
from peft_lalora.federated.launcher.processes import free_port  # noqa: E402

pytestmark = pytest.mark.slow


def _owner_only(path) -> bool:
    return stat.S_IMODE(path.stat().st_mode) == 0o600


# ------------------------------------------------------------------------------------- no processes
def test_insecure_flag_builds_the_old_command_lines_and_warns(tmp_path):
    with pytest.warns(RuntimeWarning, match="unencrypted") as rec:
        fed = LocalFederation(2, tmp_path, insecure=True)
    assert str(rec[0].message) == INSECURE_WARNING and "unauthenticated" in INSECURE_WARNING
    assert fed.tls is None
    assert fed.superlink_command() == [
        "flower-superlink",
        "--insecure",
        "--disable-runtime-dependency-installation",
        "--host",
        "127.0.0.1",
        "--port",
        str(fed.port),
    ]
    assert fed.supernode_command(1, 9101) == [
        "flower-supernode",
        "--insecure",
        "--superlink",
        f"127.0.0.1:{fed.port}",
        "--node-config",
        "num-partitions=2",
        "--host",
        "127.0.0.1",
        "--port",
        "9101",
    ]
    assert fed.config_toml() == (
        f'[superlink]\ndefault = "lalora-local"\n\n[superlink.lalora-local]\n'
        f'address = "127.0.0.1:{fed.port}"\ninsecure = true\n'
    )
    with pytest.raises(ValueError, match="no SuperNode authentication"):
        fed.supernode_command(0, 9100, tmp_path / "key")
    with pytest.raises(ValueError, match="disables TLS"):
        LocalFederation(1, tmp_path, insecure=True, tls=TLSConfig("a", "b", "c"))


def test_secure_is_the_default_and_its_command_lines(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the secure default does not warn
        fed = LocalFederation(2, tmp_path)
    cred = (tmp_path / "credentials").resolve()
    assert fed.tls == TLSConfig(cred / "ca.pem", cred / "server.pem", cred / "server.key")
    assert fed.superlink_command() == [
        "flower-superlink",
        "--ssl-ca-certfile",
        str(cred / "ca.pem"),
        "--ssl-certfile",
        str(cred / "server.pem"),
        "--ssl-keyfile",
        str(cred / "server.key"),
        "--enable-supernode-auth",
        "--disable-runtime-dependency-installation",
        "--host",
        "127.0.0.1",
        "--port",
        str(fed.port),
    ]
    assert fed.supernode_command(0, 9100, cred / "supernode-0") == [
        "flower-supernode",
        "--root-certificates",
        str(cred / "ca.pem"),
        "--auth-supernode-private-key",
        str(cred / "supernode-0"),
        "--superlink",
        f"127.0.0.1:{fed.port}",
        "--node-config",
        "num-partitions=2",
        "--host",
        "127.0.0.1",
        "--port",
        "9100",
    ]
    assert fed.config_toml().endswith(
        f'address = "127.0.0.1:{fed.port}"\nroot-certificates = "{cred / "ca.pem"}"\ninsecure = false\n'
    )
    with pytest.raises(ValueError, match="needs the SuperNode's private key"):
        fed.supernode_command(0, 9100)


def test_run_flower_forwards_insecure_and_warns(tmp_path, monkeypatch):
    """``run_flower(insecure=True)`` reaches LocalFederation (which warns) before any process starts."""
    seen = {}

    class Stop(Exception):
        pass

    def fake_start(self):
        seen["tls"] = self.tls
        raise Stop

    monkeypatch.setattr(LocalFederation, "start", fake_start)
    from peft_lalora.federated.config import FederationConfig

    # run_flower computes the plan from the shared source first (the operator's process): a buildable task
    small = dict(task="fed_tiny:tiny", num_clients=2, n_train=32, n_test=16, alpha=1.0)

    with pytest.warns(RuntimeWarning, match="unencrypted"), pytest.raises(Stop):
        flower_run.run_flower(FederationConfig(**small), workdir=tmp_path, insecure=True)
    assert seen == {"tls": None}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(Stop):
            flower_run.run_flower(FederationConfig(**small), workdir=tmp_path / "s")
    assert seen["tls"].ca_cert == (tmp_path / "s" / "credentials" / "ca.pem").resolve()


def test_generated_private_keys_are_owner_only_and_in_flowers_formats(tmp_path):
    tls = generate_tls(tmp_path / "c")
    keys = generate_node_keys(tmp_path / "c", "supernode-0")
    assert _owner_only(tls.server_key) and _owner_only(keys.private_key)
    assert not _owner_only(tls.ca_cert)  # public material stays readable
    # no CA private key on disk
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == ["ca.pem", "server.key", "server.pem", "supernode-0", "supernode-0.pub"]
    # what flower-supernode / flwr supernode register load: OpenSSH EC keys on a NIST curve, matching
    private = serialization.load_ssh_private_key(keys.private_key.read_bytes(), None)
    public = serialization.load_ssh_public_key(keys.public_key.read_bytes())
    assert isinstance(private, ec.EllipticCurvePrivateKey) and isinstance(private.curve, ec.SECP384R1)
    assert public.public_numbers() == private.public_key().public_numbers()
    # an existing, world-readable file is narrowed too
    loose = tmp_path / "loose.key"
    loose.write_bytes(b"x")
    loose.chmod(0o644)
    write_private(loose, b"secret")
    assert _owner_only(loose) and loose.read_bytes() == b"secret"


def test_server_certificate_names_loopback_and_chains_to_the_ca(tmp_path):
    tls = generate_tls(tmp_path)
    ca = x509.load_pem_x509_certificate(tls.ca_cert.read_bytes())
    cert = x509.load_pem_x509_certificate(tls.server_cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    # the key matches the certificate (ssl refuses a mismatched pair)
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(tls.server_cert, tls.server_key)


# ---------------------------------------------------------------------------------------- processes
def _wait_online(fed: LocalFederation, count: int, timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        nodes = fed.list_nodes()
        if sum(n["status"] == "online" for n in nodes) >= count or time.monotonic() > deadline:
            return nodes
        time.sleep(0.5)


def _node_ids(nodes: list[dict], status: str | None = None) -> set[int]:
    return {int(n["node-id"]) for n in nodes if status is None or n["status"] == status}


@pytest.mark.flower
def test_secure_superlink_speaks_only_tls(tmp_path):
    pytest.importorskip("flwr")
    with LocalFederation(1, tmp_path) as fed:
        registered = fed.node_ids["supernode-0"]
        # the authenticated TLS SuperNode is online: TLS with the generated CA works end to end
        assert _node_ids(_wait_online(fed, 1), "online") == {registered}
        ca_ctx = ssl.create_default_context(cafile=str(fed.tls.ca_cert))
        conn = http.client.HTTPSConnection("127.0.0.1", fed.port, context=ca_ctx, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        raw = socket.create_connection(("127.0.0.1", fed.port), timeout=10)
        with ca_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls_sock:
            assert ("IP Address", "127.0.0.1") in tls_sock.getpeercert()["subjectAltName"]
        # plain HTTP on the same port gets no answer
        plain = http.client.HTTPConnection("127.0.0.1", fed.port, timeout=10)
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            plain.request("GET", "/health")
            plain.getresponse()
        plain.close()
        # a client that does not trust the generated CA refuses the server (no silent fallback)
        untrusting = http.client.HTTPSConnection("127.0.0.1", fed.port, context=ssl.create_default_context())
        with pytest.raises(ssl.SSLCertVerificationError):
            untrusting.request("GET", "/health")
        untrusting.close()
        # an --insecure (plain-HTTP) SuperNode cannot join
        argv = [
            "flower-supernode",
            "--insecure",
            "--max-retries",
            "0",
            "--superlink",
            f"127.0.0.1:{fed.port}",
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
        ]
        proc = fed.spawn("plain-supernode", argv)
        assert proc.wait(timeout=30) != 0
        log = (fed.log_dir / "plain-supernode.log").read_text()
        assert "Failed to initialize the connection to the SuperLink" in log
        assert _node_ids(fed.list_nodes()) == {registered}
    assert fed.leftovers() == []


@pytest.mark.flower
def test_unregistered_supernode_is_refused_until_registered(tmp_path):
    pytest.importorskip("flwr")
    with LocalFederation(1, tmp_path) as fed:
        registered = fed.node_ids["supernode-0"]
        assert _node_ids(_wait_online(fed, 1), "online") == {registered}
        intruder = generate_node_keys(tmp_path / "intruder", "intruder")
        proc = fed.add_supernode(1, intruder, register=False, name="intruder")
        assert proc.wait(timeout=60) != 0, "an unregistered SuperNode must not stay up"
        assert "[code: 2004] Failed to activate SuperNode" in (fed.log_dir / "intruder.log").read_text()
        assert "No SuperNode found with the given public key" in (fed.log_dir / "superlink.log").read_text()
        assert _node_ids(fed.list_nodes()) == {registered}  # never became a node
        # a SuperNode without a key (Flower's self-registration: what any TLS client could try) is refused
        argv = fed.supernode_command(2, free_port(), intruder.private_key)
        argv = argv[:3] + argv[5:] + ["--max-retries", "0"]  # drop --auth-supernode-private-key <key>
        assert "--auth-supernode-private-key" not in argv and "--root-certificates" in argv
        proc = fed.spawn("keyless", argv)
        assert proc.wait(timeout=30) != 0
        assert "All SuperNodes must be registered via the CLI" in (fed.log_dir / "keyless.log").read_text()
        assert _node_ids(fed.list_nodes()) == {registered}
        # the same key, once registered, joins: the refusal was the missing registration
        new_id = fed.register_node(intruder.public_key)
        assert new_id != registered
        fed.add_supernode(1, intruder, register=False, name="intruder-registered")
        nodes = _wait_online(fed, 2)
        assert _node_ids(nodes, "online") == {registered, new_id}
    assert fed.leftovers() == []


# --------------------------------------------------------------------------------- full federation
@pytest.mark.flower
@pytest.mark.filterwarnings("ignore::opacus_spectral.errors.ReproducibleNoiseWarning")
def test_real_flower_federation_matches_simulation_and_cleans_up(tmp_path):
    """Moved from test_fed_runners.py; now over TLS with authenticated SuperNodes (the default)."""
    pytest.importorskip("flwr")
    pytest.importorskip("opacus_spectral")
    pytest.importorskip("flwr_datasets")
    from fed_support import CFG, assert_states_equal, marked_processes, replay
    from peft_lalora.federated.client.dp_client import REPRODUCIBLE_NOISE_NOTE
    from peft_lalora.federated.config import FederationConfig
    from peft_lalora.federated.launcher import run_flower
    from peft_lalora.federated.simulation import run_simulation

    torch.set_num_threads(1)
    cfg = FederationConfig(**CFG)
    t0 = time.perf_counter()
    out = run_flower(cfg, workdir=tmp_path, threads=1, timeout=600)
    wall = time.perf_counter() - t0
    # nothing left behind: no process carrying this federation's marker, all teardown checks empty
    assert out["leftover_pids"] == []
    assert marked_processes(out["federation_id"]) == []
    # it ran secured: TLS on the SuperLink, both SuperNodes registered by key and activated
    assert out["transport"] == {"tls": True, "supernode_auth": True}
    link_log = (tmp_path / "logs" / "superlink.log").read_text()
    assert "Uvicorn running on https://127.0.0.1:" in link_log
    assert link_log.count("[ControlServicer.RegisterNode] Created node_id=") == 2
    assert link_log.count("[Fleet.ActivateNode] Activated node_id=") == 2
    assert "Option `--insecure` was set" not in link_log
    # the global adapter changed, and it is the FedAvg of what the clients computed
    g0, g_ref, eps = replay(cfg)
    final = torch.load(out["state_path"])
    assert not all(torch.equal(final[k], g0[k]) for k in g0)
    assert_states_equal(final, g_ref, atol=1e-6)
    # same as the in-process runner, and the same privacy ledger
    sim = run_simulation(cfg, progress=False)
    assert_states_equal(final, sim.state, atol=1e-6)
    assert out["runner"] == "flower" and len(out["accuracy"]) == 3
    assert out["accuracy"] == pytest.approx(sim.accuracy, abs=1e-9)
    assert [out["epsilon"][str(i)] for i in range(2)] == pytest.approx(eps, rel=1e-9)
    assert [r["clients"] for r in out["rounds"]] == [[0, 1], [0, 1]]
    assert out["noise"]["reproducible"] is True and out["noise"]["note"] == REPRODUCIBLE_NOISE_NOTE
    assert out["failed_rounds"] == [] and [r["error"] for r in out["rounds"]] == [None, None]
    print(f"flower federation wall time: {wall:.1f}s")
