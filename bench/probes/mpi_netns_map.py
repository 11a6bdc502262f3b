"""Where Open MPI's mpirun puts two ranks given two network-namespace "hosts" (the GPU
suite's NetnsHosts and the CI test's rsh agent and sshd stand-in), outside hiber: prints
mpirun's map and each rank's network namespace. A probe for the GPU machine's Open MPI.
Usage: python3 bench/probes/mpi_netns_map.py"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "gpu"))
import suite  # noqa: E402

print({k: v for k, v in os.environ.items() if "OMPI" in k or "PMIX" in k or "PRTE" in k or "SLURM" in k})
for f in ("/etc/openmpi/openmpi-mca-params.conf", "/usr/lib/x86_64-linux-gnu/openmpi/etc/openmpi-mca-params.conf"):
    if os.path.exists(f):
        print(f, [l for l in open(f).read().splitlines() if l.strip() and not l.startswith("#")])
hosts = suite.NetnsHosts(2)
port = "2223"
sshd = []
try:
    for i in range(2):
        p = subprocess.Popen([*hosts.enter(i), "python3", str(suite.SSHD_STANDIN), hosts.addrs[i], port], stdout=subprocess.PIPE, text=True)
        sshd.append(p)
        print("sshd", i, p.stdout.readline().strip())
    net = hosts.addrs[0].rsplit(".", 1)[0] + ".0/24"
    cmd = [*hosts.enter(0), "mpirun", "--allow-run-as-root", "--oversubscribe", "--host", f"{hosts.addrs[0]}:1,{hosts.addrs[1]}:1", "-np", "2",
           "--display-map", "--display-allocation", "--mca", "plm_base_verbose", "5", "--mca", "plm_rsh_agent", str(suite.MPI_RSH_AGENT),
           "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", net, "--mca", "oob_tcp_if_include", net,
           "sh", "-c", "echo rank $OMPI_COMM_WORLD_RANK net $(readlink /proc/self/ns/net) host $(hostname)"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=dict(os.environ, HIBER_MPI_SSHD_PORT=port))
    print("rc", r.returncode)
    print(r.stdout[-6000:])
    print(r.stderr[-6000:])
    print("A", os.readlink(f"/proc/{hosts.holders[0].pid}/ns/net"), "B", os.readlink(f"/proc/{hosts.holders[1].pid}/ns/net"))
finally:
    for p in sshd:
        p.kill()
    hosts.close()
