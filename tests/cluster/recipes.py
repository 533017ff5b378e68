#!/usr/bin/env python3
"""What a cluster's operator does with a recipe of examples/clusters/, for
tests/cluster/test_recipes.sh: which processes it starts, where, with which
command and environment. Each model follows the operator's own code:

  pytorchjob  Kubeflow training-operator v1.9 (pkg/controller.v1/pytorch/envvar.go, master.go)
  trainjob    Kubeflow Trainer v2.3, torch-distributed runtime (pkg/runtime/framework/plugins/torch)
  mpijob      Kubeflow mpi-operator v0.8, v2beta1 (pkg/controller/mpi_job_controller.go)
  azureml     Azure ML command job (CLI v2), PyTorch and MPI distributions: the
              environment of the Azure ML distributed GPU training guide

  recipes.py pods FILE HOSTFILE IP...
                                  prints bash assignments: the pods (or processes) to
                                  start, each on a node (1-based), with argv and env;
                                  names to resolve (name=node); for an MPIJob, the
                                  hostfile's text (HOSTFILE: where the test writes it,
                                  /etc/mpi/hostfile in the pod); IP...: the nodes' addresses
  recipes.py check FILE NODES PER_NODE SOURCE
                                  FILE holds `dtrain_whoami --rendezvous` lines: one per
                                  rank, ranks NODES x PER_NODE, node n on host node<n+1>,
                                  contiguous ranks per node, every rank's source SOURCE

Secrets (env valueFrom.secretKeyRef) read as "secret:<name>/<key>": the same on every pod.
"""
import json
import shlex
import sys


def env_list(entries):
    """A container's env: list as (name, value) pairs; secretKeyRef values by name."""
    out = []
    for e in entries or []:
        if "value" in e:
            out.append((e["name"], str(e["value"])))
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            out.append((e["name"], f"secret:{ref['name']}/{ref['key']}"))
    return out


def merged(pairs):
    """Later entries win, as for a pod whose env names a variable twice."""
    env = {}
    for name, value in pairs:
        env[name] = value
    return env


def container(template, name=None):
    containers = template["spec"]["containers"]
    if name is None:
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def pytorchjob(job, ips):
    name = job["metadata"]["name"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    total = sum(s.get("replicas", 1) for s in specs.values())
    nproc = job["spec"].get("nprocPerNode", "auto")  # setDefaultNprocPerNode
    nproc_int = int(nproc) if str(nproc).isdigit() else 1
    master = container(specs["Master"]["template"], "pytorch")
    port = next((p["containerPort"] for p in master.get("ports", []) if p.get("name") == "pytorchjob-port"), 23456)
    master_addr = f"{name}-master-0"
    pods = []
    for rtype in ("Master", "Worker"):
        if rtype not in specs:
            continue
        c = container(specs[rtype]["template"], "pytorch")
        for index in range(specs[rtype].get("replicas", 1)):
            rank = index + (1 if rtype == "Worker" else 0)
            env = env_list(c.get("env")) + [("PYTHONUNBUFFERED", "1"),
                ("MASTER_PORT", str(port)), ("PET_MASTER_PORT", str(port)),
                ("MASTER_ADDR", master_addr), ("PET_MASTER_ADDR", master_addr),
                ("WORLD_SIZE", str(total * nproc_int)), ("RANK", str(rank)), ("PET_NODE_RANK", str(rank)),
                ("PET_NPROC_PER_NODE", str(nproc)), ("PET_NNODES", str(total))]
            pods.append((rank + 1, c.get("command", []) + c.get("args", []), merged(env)))
    return pods, {master_addr: 1}, None


def trainjob(job, ips):
    name = job["metadata"]["name"]
    trainer = job["spec"]["trainer"]
    nodes = trainer.get("numNodes", 1)
    nproc = trainer.get("numProcPerNode", "auto")
    master_addr = f"{name}-node-0-0.{name}"
    pods = []
    for index in range(nodes):
        env = env_list(trainer.get("env")) + [("PET_NNODES", str(nodes)),
            ("PET_NPROC_PER_NODE", str(nproc)), ("PET_NODE_RANK", str(index)),
            ("PET_MASTER_ADDR", master_addr), ("PET_MASTER_PORT", "29500"),
            ("JOB_COMPLETION_INDEX", str(index))]  # the indexed Job's own
        pods.append((index + 1, trainer.get("command", []) + trainer.get("args", []), merged(env)))
    return pods, {master_addr: 1}, None


def mpijob(job, ips, hostfile_path):
    name = job["metadata"]["name"]
    namespace = job["metadata"].get("namespace", "default")
    specs = job["spec"]["mpiReplicaSpecs"]
    slots = job["spec"].get("slotsPerWorker", 1)
    workers = specs["Worker"].get("replicas", 1)
    names = {f"{name}-worker-{i}.{name}.{namespace}.svc": i + 1 for i in range(workers)}
    hostfile = "".join(f"{host} slots={slots}\n" for host in names)
    c = container(specs["Launcher"]["template"])
    env = env_list(c.get("env")) + [("K_MPI_JOB_ROLE", "launcher"),
        ("OMPI_MCA_orte_keep_fqdn_hostnames", "true"),
        ("OMPI_MCA_orte_default_hostfile", hostfile_path),  # /etc/mpi/hostfile in the pod
        ("OMPI_MCA_plm_rsh_args", "-o ConnectionAttempts=10"),
        ("OMPI_MCA_orte_set_default_slots", str(slots)),
        ("NVIDIA_VISIBLE_DEVICES", ""), ("NVIDIA_DRIVER_CAPABILITIES", "")]
    launcher_node = workers + 1  # a pod of its own, on a node of its own
    return [(launcher_node, c.get("command", []) + c.get("args", []), merged(env))], names, hostfile


def azureml(job, ips):
    nodes = job["resources"]["instance_count"]
    dist = job["distribution"]
    per_node = dist.get("process_count_per_instance", 1)
    user = list((job.get("environment_variables") or {}).items())
    argv = ["bash", "-c", job["command"]]
    # A multi-node job is an Azure Batch multi-instance task: AZ_BATCH_MASTER_NODE
    # is node 0's address and a port of the Batch service's own (6000 in Azure's
    # list of its variables), which no job may use: dtrain takes the address only.
    batch = [("AZ_BATCH_MASTER_NODE", f"{ips[0]}:6000")] if nodes > 1 else []
    if dist["type"] == "pytorch":
        pods = []
        for node in range(nodes):
            for local in range(per_node):
                env = user + [("MASTER_ADDR", ips[0]), ("MASTER_PORT", "6105"),
                    ("WORLD_SIZE", str(nodes * per_node)), ("RANK", str(node * per_node + local)),
                    ("LOCAL_RANK", str(local)), ("NODE_RANK", str(node))] + batch
                pods.append((node + 1, argv, merged(env)))
        return pods, {}, None
    if dist["type"] == "mpi":
        # Azure ML runs mpirun itself: process_count_per_instance on each node, the
        # job's variables exported, AZ_BATCH_MASTER_NODE on every node of a multi-node job.
        master = batch if nodes > 1 else [("AZ_BATCHAI_MPI_MASTER_NODE", ips[0])]
        mpi = {"np": nodes * per_node, "per_node": per_node, "nodes": nodes}
        return [(1, argv, merged(user + master))], {}, mpi
    raise SystemExit(f"recipes.py: distribution type {dist['type']!r} is not modelled")


def q(value):
    return shlex.quote(str(value))


def pods_command(path, ips, hostfile_path):
    import yaml  # only here: `check` runs without it

    job = yaml.safe_load(open(path))
    kind = job.get("kind") or job.get("type")
    extra = None
    if kind == "PyTorchJob":
        pods, names, _ = pytorchjob(job, ips)
    elif kind == "TrainJob":
        pods, names, _ = trainjob(job, ips)
    elif kind == "MPIJob":
        pods, names, extra = mpijob(job, ips, hostfile_path)
    elif kind == "command":
        pods, names, extra = azureml(job, ips)
    else:
        raise SystemExit(f"recipes.py: {path}: kind {kind!r} is not modelled")
    print(f"pod_count={len(pods)}")
    for i, (node, argv, env) in enumerate(pods):
        print(f"pod_node_{i}={node}")
        print(f"pod_argv_{i}=({' '.join(q(a) for a in argv)})")
        print(f"pod_env_{i}=({' '.join(q(f'{k}={v}') for k, v in env.items())})")
    print(f"names=({' '.join(q(f'{n}={i}') for n, i in names.items())})")
    if isinstance(extra, str):
        print(f"hostfile={q(extra)}")
    elif extra:
        print(f"azure_mpi_np={extra['np']} azure_mpi_per_node={extra['per_node']} azure_mpi_nodes={extra['nodes']}")


def check(path, nodes, per_node, source):
    lines = [json.loads(l) for l in open(path) if l.startswith("{")]
    size = nodes * per_node
    got = {w["rank"]: w for w in lines}
    ok = len(lines) == size and set(got) == set(range(size))
    if not ok:
        print(f"expected one line from each of ranks 0..{size - 1}, got {len(lines)} lines "
              f"from ranks {sorted(got)}")
    for rank in range(size):
        w = got.get(rank)
        if w is None:
            continue
        node, local = divmod(rank, per_node)
        want = dict(world_size=size, num_nodes=nodes, local_world_size=per_node,
                    node_rank=node, local_rank=local, host=f"node{node + 1}", source=source)
        wrong = {k: (w.get(k), v) for k, v in want.items() if w.get(k) != v}
        print(f"rank {rank}: {json.dumps(w)}" + (f"  WRONG (got, want): {wrong}" if wrong else ""))
        ok = ok and not wrong
    return ok


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "pods":
        pods_command(sys.argv[2], sys.argv[4:], sys.argv[3])
    elif len(sys.argv) == 6 and sys.argv[1] == "check":
        sys.exit(0 if check(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]) else 1)
    else:
        sys.exit(__doc__)
