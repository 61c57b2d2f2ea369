//! Device discovery and the attribute types `Context` reports.

use std::fmt;
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::ffi;
use crate::sys::call::verb;
pub(crate) use crate::sys::cstr::{carray, cstr};

pub use crate::values::{
    AtomicCap, Gid, GidEntry, GidType, LinkLayer, Mtu, NodeType, PortState, Transport,
};

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
#[doc(alias = "ibv_get_device_list")]
pub fn devices() -> Result<DeviceList> {
    let mut n: i32 = 0;
    // SAFETY: plain call with a valid out-pointer.
    match verb!(ptr: unsafe { ffi::ibv_get_device_list(&mut n) }) {
        Ok(list) => Ok(DeviceList {
            list,
            len: usize::try_from(n).unwrap_or(0),
        }),
        Err(failed) => match failed.errno() {
            Some(libc::ENOSYS) | Some(libc::ENODEV) | Some(libc::ENOENT) => {
                Err(Error::NoRdmaSupport { verb: failed.verb })
            }
            _ => Err(failed.into()),
        },
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
#[doc(alias = "ibv_device")]
#[derive(Clone, Copy)]
pub struct Device<'list> {
    raw: NonNull<ffi::ibv_device>,
    _list: &'list DeviceList,
}

impl Device<'_> {
    /// Kernel device name (`ibv_get_device_name`), e.g. `rxe0` or `mlx5_0`.
    #[doc(alias = "ibv_get_device_name")]
    pub fn name(&self) -> String {
        // SAFETY: raw is valid while the list lives; ibv_get_device_name returns a
        // NUL-terminated string inside the device struct.
        unsafe { cstr(ffi::ibv_get_device_name(self.raw.as_ptr())) }
    }

    /// Node GUID in host byte order (`ibv_get_device_guid`; printed as in
    /// `ibv_devices`).
    #[doc(alias = "ibv_get_device_guid")]
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

    /// Opens the device (`ibv_open_device`).
    #[doc(alias = "ibv_open_device")]
    pub fn open(&self) -> Result<crate::context::Context> {
        crate::context::Context::from_device(self.raw)
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
    fn multicast_gids_are_told_as_the_kernel_tells_them() {
        let gid = |s: &str| s.parse::<Gid>().unwrap();
        for m in [
            "ff0e::1",
            "ff02::1:ff00:1",
            "::ffff:224.0.0.1",
            "::ffff:239.255.255.255",
        ] {
            assert!(gid(m).is_multicast(), "{m}");
        }
        for u in [
            "::ffff:10.99.0.1",
            "::ffff:240.0.0.1",
            "fe80::1",
            "::",
            "::e000:1",
        ] {
            assert!(!gid(u).is_multicast(), "{u}");
        }
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
