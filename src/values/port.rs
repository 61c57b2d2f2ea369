//! What a device and its ports report: node type, port state, MTU, link layer, GIDs.

use std::fmt;
use std::net::Ipv6Addr;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::ffi;
use crate::sys::c_enum;

c_enum! {
    /// Kind of RDMA node (`ibv_node_type`).
    pub enum NodeType: i32 {
        /// Channel adapter (InfiniBand HCA, RoCE NIC, soft-RoCE).
        Ca = ffi::IBV_NODE_CA => "InfiniBand channel adapter",
        /// InfiniBand switch.
        Switch = ffi::IBV_NODE_SWITCH => "InfiniBand switch",
        /// InfiniBand router.
        Router = ffi::IBV_NODE_ROUTER => "InfiniBand router",
        /// iWARP NIC.
        Rnic = ffi::IBV_NODE_RNIC => "iWARP NIC",
        /// Cisco usNIC.
        Usnic = ffi::IBV_NODE_USNIC => "usNIC",
        /// Cisco usNIC over UDP.
        UsnicUdp = ffi::IBV_NODE_USNIC_UDP => "usNIC UDP",
        /// Unspecified.
        Unspecified = ffi::IBV_NODE_UNSPECIFIED => "unspecified",
    }
}

c_enum! {
    /// Transport a device speaks (`ibv_transport_type`).
    pub enum Transport: i32 {
        /// InfiniBand transport (also RoCE).
        Ib = ffi::IBV_TRANSPORT_IB => "InfiniBand",
        /// iWARP.
        Iwarp = ffi::IBV_TRANSPORT_IWARP => "iWARP",
        /// usNIC.
        Usnic = ffi::IBV_TRANSPORT_USNIC => "usNIC",
        /// usNIC UDP.
        UsnicUdp = ffi::IBV_TRANSPORT_USNIC_UDP => "usNIC UDP",
        /// Unspecified.
        Unspecified = ffi::IBV_TRANSPORT_UNSPECIFIED => "unspecified",
    }
}

c_enum! {
    /// Logical port state (`ibv_port_state`).
    pub enum PortState: u32 {
        /// No state change.
        Nop = ffi::IBV_PORT_NOP => "PORT_NOP",
        /// Link down.
        Down = ffi::IBV_PORT_DOWN => "PORT_DOWN",
        /// Link up, not configured.
        Init = ffi::IBV_PORT_INIT => "PORT_INIT",
        /// Configured, not active.
        Armed = ffi::IBV_PORT_ARMED => "PORT_ARMED",
        /// Ready for traffic.
        Active = ffi::IBV_PORT_ACTIVE => "PORT_ACTIVE",
        /// Active, deferring.
        ActiveDefer = ffi::IBV_PORT_ACTIVE_DEFER => "PORT_ACTIVE_DEFER",
    }
}

c_enum! {
    /// Path MTU (`ibv_mtu`).
    pub enum Mtu: u32 {
        /// 256 bytes.
        Mtu256 = ffi::IBV_MTU_256 => "256",
        /// 512 bytes.
        Mtu512 = ffi::IBV_MTU_512 => "512",
        /// 1024 bytes.
        Mtu1024 = ffi::IBV_MTU_1024 => "1024",
        /// 2048 bytes.
        Mtu2048 = ffi::IBV_MTU_2048 => "2048",
        /// 4096 bytes.
        Mtu4096 = ffi::IBV_MTU_4096 => "4096",
    }
}

impl Mtu {
    /// The MTU in bytes (0 for unknown values).
    pub fn bytes(self) -> u32 {
        match self {
            Mtu::Mtu256 => 256,
            Mtu::Mtu512 => 512,
            Mtu::Mtu1024 => 1024,
            Mtu::Mtu2048 => 2048,
            Mtu::Mtu4096 => 4096,
            Mtu::Unknown(_) => 0,
        }
    }

    /// The MTU for a byte count as `ibv_rc_pingpong -m` takes it; `None` if not one of 256..4096.
    pub fn from_bytes(bytes: u32) -> Option<Mtu> {
        Some(match bytes {
            256 => Mtu::Mtu256,
            512 => Mtu::Mtu512,
            1024 => Mtu::Mtu1024,
            2048 => Mtu::Mtu2048,
            4096 => Mtu::Mtu4096,
            _ => return None,
        })
    }
}

c_enum! {
    /// Link layer of a port.
    pub enum LinkLayer: u8 {
        /// Not reported (old kernels; treat as InfiniBand).
        Unspecified = ffi::IBV_LINK_LAYER_UNSPECIFIED => "Unspecified",
        /// InfiniBand.
        InfiniBand = ffi::IBV_LINK_LAYER_INFINIBAND => "InfiniBand",
        /// Ethernet (RoCE, soft-RoCE).
        Ethernet = ffi::IBV_LINK_LAYER_ETHERNET => "Ethernet",
    }
}

c_enum! {
    /// Atomic operation support level (`ibv_atomic_cap`).
    pub enum AtomicCap: u32 {
        /// No atomics.
        None = ffi::IBV_ATOMIC_NONE => "ATOMIC_NONE",
        /// Atomic with respect to this device only.
        Hca = ffi::IBV_ATOMIC_HCA => "ATOMIC_HCA",
        /// Atomic with respect to the CPU too.
        Glob = ffi::IBV_ATOMIC_GLOB => "ATOMIC_GLOB",
    }
}

c_enum! {
    /// Type of a GID table entry.
    pub enum GidType: u32 {
        /// InfiniBand GID.
        Ib = ffi::IBV_GID_TYPE_IB => "IB",
        /// RoCE v1 (Ethernet, ethertype 0x8915).
        RoceV1 = ffi::IBV_GID_TYPE_ROCE_V1 => "RoCE v1",
        /// RoCE v2 (UDP port 4791, routable).
        RoceV2 = ffi::IBV_GID_TYPE_ROCE_V2 => "RoCE v2",
    }
}

/// A 128-bit Global Identifier.
///
/// Prints like rdma-core's tools (`inet_ntop`): `fe80::5054:ff:fe12:3456`,
/// `::ffff:10.99.0.1`. Parses that form and the 32-hex-digit wire form
/// `ibv_rc_pingpong` exchanges.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The all-zero GID (an empty table slot).
    pub const ZERO: Gid = Gid([0; 16]);

    /// The raw bytes, network order.
    pub fn raw(&self) -> [u8; 16] {
        self.0
    }

    /// True for the all-zero GID.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// The subnet prefix (first 8 bytes) as a host-order integer.
    pub fn subnet_prefix(&self) -> u64 {
        u64::from_be_bytes(self.0[..8].try_into().expect("8 bytes"))
    }

    /// The interface ID (last 8 bytes) as a host-order integer.
    pub fn interface_id(&self) -> u64 {
        u64::from_be_bytes(self.0[8..].try_into().expect("8 bytes"))
    }

    /// True for a multicast GID as the kernel tells one (`rdma_is_multicast_addr`):
    /// IPv6 multicast (`ff00::/8`), or an IPv4-mapped multicast address
    /// (`::ffff:224.0.0.0/100`, what RoCE v2 uses for an IPv4 group).
    pub fn is_multicast(&self) -> bool {
        self.0[0] == 0xff || (self.is_ipv4_mapped() && (224..=239).contains(&self.0[12]))
    }

    /// True for an IPv4-mapped GID (`::ffff:a.b.c.d`): what RoCE v2 uses for
    /// an interface's IPv4 address.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.0[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]
    }

    /// The GID as an IPv6 address (RoCE v2 GIDs are the interface's
    /// addresses; an IPv4 one shows as `::ffff:a.b.c.d`).
    pub fn to_ipv6(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.0)
    }

    /// The 32 lowercase hex digits `ibv_rc_pingpong` puts on the wire.
    pub fn to_wire_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub(crate) fn from_ffi(g: &ffi::ibv_gid) -> Gid {
        // SAFETY: every bit pattern of the union is a valid [u8; 16].
        Gid(unsafe { g.raw })
    }

    pub(crate) fn to_ffi(self) -> ffi::ibv_gid {
        ffi::ibv_gid { raw: self.0 }
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&Ipv6Addr::from(self.0), f)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

impl FromStr for Gid {
    type Err = Error;

    fn from_str(s: &str) -> Result<Gid> {
        let t = s.trim();
        if let Ok(ip) = t.parse::<Ipv6Addr>() {
            return Ok(Gid(ip.octets()));
        }
        if t.len() == 32 && t.bytes().all(|b| b.is_ascii_hexdigit()) {
            let mut raw = [0u8; 16];
            for (i, byte) in raw.iter_mut().enumerate() {
                *byte = u8::from_str_radix(&t[2 * i..2 * i + 2], 16).map_err(|_| {
                    Error::InvalidGid {
                        input: s.to_owned(),
                    }
                })?;
            }
            return Ok(Gid(raw));
        }
        Err(Error::InvalidGid {
            input: s.to_owned(),
        })
    }
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the table (what `--gid-index` / `-x` selects). Address
    /// vectors carry it in 8 bits, so every GID index in this crate is a `u8`.
    pub index: u8,
    /// Port number.
    pub port: u8,
    /// The GID.
    pub gid: Gid,
    /// IB, RoCE v1 or RoCE v2.
    pub gid_type: GidType,
    /// The network interface it belongs to (RoCE), e.g. `veth0`.
    pub netdev: Option<String>,
}
