//! How a guest is wired ([`Topology`]): its QEMU network devices, the network setup inside
//! it and the addresses its command is told about.

use crate::choice::Provider;

/// How a guest is wired. The network setup, the QEMU network devices and the addresses the
/// command is told about all come from here.
#[derive(Clone, Copy, Debug)]
pub enum Topology {
    /// One guest, one veth pair (veth0 = 10.99.0.1/24), rxe0 on veth0; client and server run
    /// in the same guest and share rxe0, which loops packets back to itself.
    Loopback,
    /// One of two guests on a virtual wire (see [`run_pair`](super::run_pair)): a virtio-net NIC (eth0 =
    /// 10.99.1.`node`/24) joined to the other guest's by QEMU's UDP socket netdev on
    /// 127.0.0.1, rxe0 on eth0. RoCE v2 packets cross both guests' network stacks, so
    /// `tc qdisc ... netem` and `ip link set eth0 down` on either side act on them.
    Wire {
        /// 1 or 2.
        node: u8,
        /// The UDP port on 127.0.0.1 this guest's NIC receives on.
        local_port: u16,
        /// The UDP port on 127.0.0.1 the other guest's NIC receives on.
        peer_port: u16,
    },
    /// One of 3 or 4 guests on a virtual switch (see [`run_nodes`](super::run_nodes)): the
    /// same NIC, addresses and RDMA device as [`Topology::Wire`], but its UDP socket netdev
    /// talks to its own port of the runner's switch thread, which relays each frame to the
    /// guest that owns the destination MAC, or to every other guest for broadcast and
    /// multicast frames. Every guest reaches every other one.
    Switch {
        /// 1 to `nodes`.
        node: u8,
        /// How many guests share the switch.
        nodes: u8,
        /// The UDP port on 127.0.0.1 this guest's NIC receives on.
        local_port: u16,
        /// The switch's UDP port on 127.0.0.1 for this guest.
        switch_port: u16,
    },
}

/// The address of node `node` (1 to 4) of guests on a wire or a switch: 10.99.1.`node`.
pub fn wire_addr(node: u8) -> String {
    format!("10.99.1.{node}")
}

/// The NIC of node `node`: virtio-net on the UDP socket netdev `udp` (`host:port` the
/// frames go to) received on `local` (only ever 127.0.0.1, never the outside).
fn socket_nic(node: u8, udp: u16, local: u16) -> Vec<String> {
    vec![
        "-netdev".into(),
        format!("socket,id=n0,udp=127.0.0.1:{udp},localaddr=127.0.0.1:{local}"),
        "-device".into(),
        format!("virtio-net-pci,netdev=n0,romfile=,mac=52:54:00:99:01:{node:02x}"),
    ]
}

impl Topology {
    /// Extra QEMU arguments for the guest's network devices: none for [`Topology::Loopback`]
    /// (`-nic none` stays), one virtio-net NIC on a UDP socket to the other guest
    /// ([`Topology::Wire`]) or to the switch ([`Topology::Switch`]), only ever on 127.0.0.1.
    pub(super) fn qemu_net_args(self) -> Vec<String> {
        match self {
            Topology::Loopback => Vec::new(),
            Topology::Wire {
                node,
                local_port,
                peer_port,
            } => socket_nic(node, peer_port, local_port),
            Topology::Switch {
                node,
                local_port,
                switch_port,
                ..
            } => socket_nic(node, switch_port, local_port),
        }
    }

    /// CPUs of the guest: two for the lone guest, one each for guests on a wire or a switch
    /// (the 2-core hosts this runs on would otherwise be oversubscribed).
    pub(super) fn cpus(self) -> &'static str {
        match self {
            Topology::Loopback => "2",
            Topology::Wire { .. } | Topology::Switch { .. } => "1",
        }
    }

    /// Guest memory in MiB unless `RDMA_VERBS_VM_MEM_MB` says otherwise: 2048 for one or
    /// two guests, 1024 each for 3 or 4 on a switch (4 GiB in all, which hosts with 8 GiB
    /// take).
    pub(super) fn default_memory_mb(self) -> u32 {
        match self {
            Topology::Loopback | Topology::Wire { .. } => 2048,
            Topology::Switch { .. } => 1024,
        }
    }

    /// `network.sh`: run by busybox sh in the initramfs before the command; brings the RDMA
    /// device of `provider` up. Busybox does what it can (its static binary starts much
    /// faster under emulation than the host's dynamic ones); creating the veth pair (busybox's
    /// `ip` cannot) and the RDMA link (rxe and siw turn ACTIVE when their netdev goes up
    /// later) use the host's iproute2 through one chroot. Output goes to the console log.
    pub(super) fn setup_script(self, provider: Provider) -> String {
        let device = provider.device();
        let kind = provider.name();
        let wait_active = format!(
            "i=0\n\
             until grep -q ACTIVE /sys/class/infiniband/{device}/ports/1/state; do\n\
             \x20 i=$((i + 1)); [ $i -lt 50 ] || {{ echo '{device} port 1 is not ACTIVE'; exit 1; }}\n\
             \x20 sleep 0.1\n\
             done\n"
        );
        match self {
            Topology::Loopback => format!(
                "set -e\n\
                 ip link set lo up\n\
                 chroot /host /bin/sh -ec 'PATH=/usr/sbin:/usr/bin:/sbin:/bin\n\
                 \x20 ip link add veth0 type veth peer name veth1\n\
                 \x20 rdma link add {device} type {kind} netdev veth0'\n\
                 ip addr add 10.99.0.1/24 dev veth0\n\
                 ip link set veth0 up\n\
                 ip link set veth1 up\n\
                 {wait_active}"
            ),
            Topology::Wire { node, .. } | Topology::Switch { node, .. } => format!(
                "set -e\n\
                 ip link set lo up\n\
                 i=0\n\
                 until [ -e /sys/class/net/eth0 ]; do\n\
                 \x20 i=$((i + 1)); [ $i -lt 50 ] || {{ echo 'no eth0'; exit 1; }}\n\
                 \x20 sleep 0.1\n\
                 done\n\
                 chroot /host /bin/sh -ec 'PATH=/usr/sbin:/usr/bin:/sbin:/bin\n\
                 \x20 rdma link add {device} type {kind} netdev eth0'\n\
                 ip addr add {}/24 dev eth0\n\
                 ip link set eth0 up\n\
                 {wait_active}",
                wire_addr(node)
            ),
        }
    }

    /// Environment the command gets to find the device of `provider`: name and local
    /// address; on a wire or a switch also the node number (`RDMA_VERBS_NODE`), the number
    /// of nodes (`RDMA_VERBS_NODES`), the addresses of all other nodes in node order
    /// (`RDMA_VERBS_PEERS`, space-separated) and one peer's address (`RDMA_VERBS_PEER`:
    /// the next node, node 1 after the last; on a wire, the other node).
    pub fn guest_env(self, provider: Provider) -> Vec<(&'static str, String)> {
        let device = provider.device();
        let (node, nodes) = match self {
            Topology::Loopback => {
                return vec![
                    ("RDMA_VERBS_DEVICE", device.into()),
                    ("RDMA_VERBS_ADDR", "10.99.0.1".into()),
                ];
            }
            Topology::Wire { node, .. } => (node, 2),
            Topology::Switch { node, nodes, .. } => (node, nodes),
        };
        let peers: Vec<String> = (1..=nodes).filter(|&n| n != node).map(wire_addr).collect();
        vec![
            ("RDMA_VERBS_DEVICE", device.into()),
            ("RDMA_VERBS_NODE", node.to_string()),
            ("RDMA_VERBS_NODES", nodes.to_string()),
            ("RDMA_VERBS_ADDR", wire_addr(node)),
            ("RDMA_VERBS_PEER", wire_addr(node % nodes + 1)),
            ("RDMA_VERBS_PEERS", peers.join(" ")),
        ]
    }
}
