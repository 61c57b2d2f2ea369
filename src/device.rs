//! Device discovery and the attribute types `Context` reports.

use std::ffi::CStr;
use std::fmt;
use std::net::Ipv6Addr;
use std::ptr::NonNull;
use std::str::FromStr;

use crate::enums::c_enum;
use crate::error::{Error, Result, last_errno};
use crate::ffi;

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

/// The list of RDMA devices on this host (`ibv_get_device_list`).
pub struct DeviceList {
    list: NonNull<*mut ffi::ibv_device>,
    len: usize,
}

// SAFETY: the list is an immutable array owned by this value; libibverbs allows
// using it from any thread.
unsafe impl Send for DeviceList {}
// SAFETY: only read access is offered through &self.
unsafe impl Sync for DeviceList {}

/// Lists the RDMA devices (`ibv_get_device_list`).
///
/// Fails with [`Error::NoRdmaSupport`] when the kernel has no RDMA support at
/// all; an empty list is `Ok` (see [`DeviceList::is_empty`]).
pub fn devices() -> Result<DeviceList> {
    let mut n: i32 = 0;
    // SAFETY: plain call with a valid out-pointer.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    match NonNull::new(list) {
        Some(list) => Ok(DeviceList {
            list,
            len: usize::try_from(n).unwrap_or(0),
        }),
        None => {
            let e = last_errno();
            match e.raw_os_error() {
                Some(libc::ENOSYS) | Some(libc::ENODEV) | Some(libc::ENOENT) => {
                    Err(Error::NoRdmaSupport {
                        verb: "ibv_get_device_list",
                    })
                }
                _ => Err(Error::verb("ibv_get_device_list", e)),
            }
        }
    }
}

impl DeviceList {
    /// Number of devices.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no device is present.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The devices.
    pub fn iter(&self) -> impl Iterator<Item = Device<'_>> {
        (0..self.len).map(move |i| {
            // SAFETY: i < len, the array holds len valid non-null pointers.
            let p = unsafe { *self.list.as_ptr().add(i) };
            Device {
                raw: NonNull::new(p).expect("ibv_get_device_list entries are non-null"),
                _list: self,
            }
        })
    }

    /// The device with this name, or the first one when `name` is `None`.
    pub fn find(&self, name: Option<&str>) -> Result<Device<'_>> {
        if self.is_empty() {
            return Err(Error::NoDevices);
        }
        match name {
            None => Ok(self.iter().next().expect("non-empty")),
            Some(n) => self
                .iter()
                .find(|d| d.name() == n)
                .ok_or_else(|| Error::DeviceNotFound {
                    name: n.to_owned(),
                    available: self.iter().map(|d| d.name()).collect::<Vec<_>>().join(", "),
                }),
        }
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once; open
        // contexts stay valid after this (libibverbs documents it).
        unsafe { ffi::ibv_free_device_list(self.list.as_ptr()) };
    }
}

impl fmt::Debug for DeviceList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// One device in a [`DeviceList`]; open it with [`Device::open`].
#[derive(Clone, Copy)]
pub struct Device<'list> {
    raw: NonNull<ffi::ibv_device>,
    _list: &'list DeviceList,
}

impl Device<'_> {
    /// Kernel device name, e.g. `rxe0` or `mlx5_0`.
    pub fn name(&self) -> String {
        // SAFETY: raw is valid while the list lives; ibv_get_device_name returns a
        // NUL-terminated string inside the device struct.
        unsafe { cstr(ffi::ibv_get_device_name(self.raw.as_ptr())) }
    }

    /// Node GUID in host byte order (printed as in `ibv_devices`).
    pub fn guid(&self) -> u64 {
        // SAFETY: raw is valid while the list lives.
        u64::from_be(unsafe { ffi::ibv_get_device_guid(self.raw.as_ptr()) })
    }

    /// Node type.
    pub fn node_type(&self) -> NodeType {
        // SAFETY: raw is valid while the list lives; reading a plain field.
        NodeType::from_raw(unsafe { (*self.raw.as_ptr()).node_type })
    }

    /// Transport type.
    pub fn transport(&self) -> Transport {
        // SAFETY: as above.
        Transport::from_raw(unsafe { (*self.raw.as_ptr()).transport_type })
    }

    /// Opens the device.
    pub fn open(&self) -> Result<crate::Context> {
        crate::Context::from_device(self.raw)
    }

    /// The raw `ibv_device` pointer, valid while the list lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_device {
        self.raw.as_ptr()
    }
}

impl fmt::Debug for Device<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name())
            .field("guid", &format_args!("{}", format_guid(self.guid())))
            .field("node_type", &self.node_type())
            .field("transport", &self.transport())
            .finish()
    }
}

/// Formats a GUID the way `ibv_devinfo` does: `xxxx:xxxx:xxxx:xxxx`.
pub fn format_guid(guid: u64) -> String {
    format!(
        "{:04x}:{:04x}:{:04x}:{:04x}",
        (guid >> 48) & 0xffff,
        (guid >> 32) & 0xffff,
        (guid >> 16) & 0xffff,
        guid & 0xffff
    )
}

/// Copies a C string into a `String` (lossy); empty for NULL.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string valid for the call.
pub(crate) unsafe fn cstr(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: guaranteed by the caller.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Reads a fixed-size C char array up to its first NUL.
pub(crate) fn carray(a: &[std::os::raw::c_char]) -> String {
    let bytes: Vec<u8> = a
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gid_round_trips_rdma_core_forms() {
        for s in ["::ffff:10.99.0.1", "fe80::5054:ff:fe12:3456", "::"] {
            let g: Gid = s.parse().unwrap();
            assert_eq!(g.to_string(), s);
        }
        let g: Gid = "::ffff:10.99.0.1".parse().unwrap();
        assert_eq!(g.raw()[10..], [0xff, 0xff, 10, 99, 0, 1]);
        assert_eq!(g.to_wire_hex(), "00000000000000000000ffff0a630001");
        assert_eq!(
            "00000000000000000000ffff0a630001".parse::<Gid>().unwrap(),
            g
        );
        assert_eq!(g.subnet_prefix(), 0);
        assert_eq!(g.interface_id(), 0x0000_ffff_0a63_0001);
    }

    #[test]
    fn bad_gids_are_typed_errors() {
        for s in [
            "",
            "fe80::zz",
            "10.0.0.1",
            "0000",
            "00000000000000000000ffff0a63000g",
            "1:2:3:4:5:6:7:8:9",
        ] {
            match s.parse::<Gid>() {
                Err(Error::InvalidGid { input }) => assert_eq!(input, s),
                other => panic!("{s:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn c_enums_keep_unknown_values() {
        assert_eq!(PortState::from_raw(4), PortState::Active);
        assert_eq!(PortState::Active.to_string(), "PORT_ACTIVE");
        assert_eq!(PortState::from_raw(77), PortState::Unknown(77));
        assert_eq!(PortState::from_raw(77).as_raw(), 77);
        assert_eq!(Mtu::from_bytes(1024), Some(Mtu::Mtu1024));
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        assert_eq!(Mtu::from_bytes(1000), None);
        assert_eq!(GidType::from_raw(2).to_string(), "RoCE v2");
    }

    #[test]
    fn guid_formats_like_ibv_devinfo() {
        assert_eq!(format_guid(0x5054_00ff_fe12_3456), "5054:00ff:fe12:3456");
    }
}
