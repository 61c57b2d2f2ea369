//! `Context`: an open RDMA device.

use std::fmt;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::device::{self, AtomicCap, Gid, GidEntry, GidType, LinkLayer, Mtu, PortState};
use crate::error::{Error, Result};
use crate::ffi;
use crate::sys::call::verb;

/// An open RDMA device (`ibv_context`).
///
/// Cheap to clone (reference counted); every object created from it keeps it
/// open, so the device is closed only after the last `Pd`, `Cq`, `Qp`... is gone.
#[doc(alias = "ibv_context")]
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

pub(crate) struct ContextInner {
    pub(crate) raw: NonNull<ffi::ibv_context>,
    name: String,
    /// `Some` for a context this crate did not open ([`Context::borrowed`]):
    /// it is not closed on drop, and this owner keeps it open until then.
    owner: Option<Box<dyn std::any::Any + Send + Sync>>,
    /// What each port queried so far cannot change while the device is open
    /// (its link layer, its P_Key table's length): checks on every QP's
    /// transitions read it here instead of asking the kernel again.
    port_facts: std::sync::Mutex<Vec<(u8, PortFacts)>>,
    /// Whether RC QPs of this context take ATOMIC_WRITE: 0 not asked yet, 1 yes,
    /// 2 no (the device lacks it, or its provider refused a QP with it).
    atomic_write: std::sync::atomic::AtomicU8,
    /// The FLUSH placement types (`ffi::IBV_FLUSH_GLOBAL`, `ffi::IBV_FLUSH_PERSISTENT`)
    /// RC QPs of this context take, with `ext_ops::FLUSH_ASKED` set once known: 0 not asked yet.
    flush: std::sync::atomic::AtomicU8,
}

mod ext_ops;
mod iwarp;

/// The attributes of a port that stay as they are while the device is open.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PortFacts {
    /// Ethernet (RoCE) or InfiniBand.
    pub(crate) link_layer: LinkLayer,
    /// Entries of the P_Key table.
    pub(crate) pkey_tbl_len: u16,
    /// The active MTU when first queried: it can change (the netdev's MTU),
    /// so only a value above it is worth a fresh query.
    pub(crate) first_active_mtu: crate::device::Mtu,
}

// SAFETY: libibverbs contexts may be used from any thread; the verbs this crate
// calls through &Context (query_*, alloc_pd, create_cq, ...) are thread-safe per
// rdma-core's documentation.
unsafe impl Send for ContextInner {}
// SAFETY: see Send; the only state this crate mutates through &self is
// behind a Mutex (`port_facts`).
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        if self.owner.is_some() {
            // Borrowed: its owner closes it (after `owner` is dropped, below).
            return;
        }
        // SAFETY: raw came from ibv_open_device; all children hold an Arc to this
        // inner, so none is alive anymore. A failure is ignored: Drop never panics.
        unsafe { ffi::ibv_close_device(self.raw.as_ptr()) };
    }
}

impl Context {
    /// Opens the device named `name`, or the first device when `None`
    /// (`ibv_get_device_list`, then `ibv_open_device`).
    ///
    /// ```no_run
    /// let ctx = rdma_verbs::context::Context::open(Some("rxe0"))?;
    /// println!("{}", ctx.name());
    /// # Ok::<(), rdma_verbs::Error>(())
    /// ```
    #[doc(alias = "ibv_open_device")]
    pub fn open(name: Option<&str>) -> Result<Context> {
        let list = device::devices()?;
        list.find(name)?.open()
    }

    pub(crate) fn from_device(dev: NonNull<ffi::ibv_device>) -> Result<Context> {
        // SAFETY: dev is a valid device pointer from a live device list.
        let raw = verb!(ptr: unsafe { ffi::ibv_open_device(dev.as_ptr()) })?;
        // SAFETY: dev is valid; the name is a NUL-terminated array inside it.
        let name = unsafe { device::cstr(ffi::ibv_get_device_name(dev.as_ptr())) };
        Ok(Context {
            inner: Arc::new(ContextInner {
                raw,
                name,
                owner: None,
                port_facts: Default::default(),
                atomic_write: Default::default(),
                flush: Default::default(),
            }),
        })
    }

    /// Wraps a context that something else opened and will close, such as
    /// the per-device context librdmacm opens for its ids (`rdma_cm_id.verbs`,
    /// see [`crate::cm`]). Dropping the last clone does **not** call
    /// `ibv_close_device`; it drops `owner` instead.
    ///
    /// # Safety
    /// `raw` is a valid `ibv_context` that stays open at least until `owner`
    /// is dropped (e.g. `owner` holds a reference that keeps it open).
    pub(crate) unsafe fn borrowed(
        raw: NonNull<ffi::ibv_context>,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Context {
        // SAFETY: raw is valid (caller); device is set for every open context,
        // and its name is a NUL-terminated array inside it.
        let name = unsafe { device::cstr(ffi::ibv_get_device_name((*raw.as_ptr()).device)) };
        Context {
            inner: Arc::new(ContextInner {
                raw,
                name,
                owner: Some(owner),
                port_facts: Default::default(),
                atomic_write: Default::default(),
                flush: Default::default(),
            }),
        }
    }

    /// The device name, e.g. `rxe0`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The raw `ibv_context`, valid while this `Context` (or any clone) lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_context {
        self.inner.raw.as_ptr()
    }

    /// Device attributes (`ibv_query_device_ex`).
    #[doc(alias("ibv_query_device_ex", "ibv_query_device"))]
    pub fn query_device(&self) -> Result<DeviceAttr> {
        let mut attr = MaybeUninit::<ffi::ibv_device_attr_ex>::zeroed();
        // SAFETY: valid context; attr is a zeroed out-struct of the right type;
        // a NULL input means "no extended input".
        verb!(rc: unsafe {
            ffi::ibv_query_device_ex(self.as_raw(), std::ptr::null(), attr.as_mut_ptr())
        })?;
        // SAFETY: zero-initialised and then filled by the call; all-integer struct.
        let attr = unsafe { attr.assume_init() };
        Ok(DeviceAttr::from_ffi(&attr))
    }

    /// `e` (a queue that does not fit its CQ), or, when `want` is past the
    /// device's own limit (`max` of its attributes, named `limit`), the
    /// error that says so: no CQ could hold such a queue, since the device
    /// refuses it anyway.
    #[cold]
    pub(crate) fn over_limit(
        &self,
        e: Error,
        field: &'static str,
        want: u32,
        limit: &str,
        max: impl Fn(&DeviceAttr) -> i32,
    ) -> Error {
        match self.query_device() {
            Ok(a) if i64::from(want) > i64::from(max(&a)) => Error::InvalidArgument {
                what: field,
                reason: format!("{want} is past the device's {limit} of {}", max(&a)),
            },
            _ => e,
        }
    }

    /// The fixed attributes of `port`, queried once per context.
    pub(crate) fn port_facts(&self, port: u8) -> Result<PortFacts> {
        let lock = || {
            self.inner
                .port_facts
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        if let Some(&(_, f)) = lock().iter().find(|(p, _)| *p == port) {
            return Ok(f);
        }
        let a = self.query_port(port)?;
        let f = PortFacts {
            link_layer: a.link_layer,
            pkey_tbl_len: a.pkey_tbl_len,
            first_active_mtu: a.active_mtu,
        };
        lock().push((port, f));
        Ok(f)
    }

    /// Port attributes (`ibv_query_port`, through the current ABI `___ibv_query_port`).
    #[doc(alias = "ibv_query_port")]
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let mut attr = MaybeUninit::<ffi::ibv_port_attr>::zeroed();
        // SAFETY: valid context and out-pointer; ___ibv_query_port is the header's
        // non-compat path (plain ibv_query_port is the old ABI symbol).
        let done = verb!(rc: unsafe {
            ffi::___ibv_query_port(self.as_raw(), port, attr.as_mut_ptr())
        });
        if let Err(failed) = done {
            return Err(if failed.errno() == Some(libc::EINVAL) {
                Error::InvalidArgument {
                    what: "port",
                    reason: format!("port {port} does not exist on {}", self.name()),
                }
            } else {
                failed.into()
            });
        }
        // SAFETY: filled by the call; all-integer struct.
        let attr = unsafe { attr.assume_init() };
        Ok(PortAttr::from_ffi(&attr))
    }

    /// One GID (`ibv_query_gid`). An index past the table, or an empty slot
    /// (the all-zero GID), is an error naming the valid indices.
    #[doc(alias = "ibv_query_gid")]
    pub fn query_gid(&self, port: u8, index: u8) -> Result<Gid> {
        let mut gid = ffi::ibv_gid { raw: [0; 16] };
        // SAFETY: valid context and out-pointer.
        let rc = unsafe { ffi::ibv_query_gid(self.as_raw(), port, index.into(), &mut gid) };
        let gid = Gid::from_ffi(&gid);
        if rc != 0 || gid.is_zero() {
            // A port that does not exist is named as such.
            self.query_port(port)?;
            return Err(self.no_gid(port, index));
        }
        Ok(gid)
    }

    #[cold]
    fn no_gid(&self, port: u8, index: u8) -> Error {
        let valid: Vec<String> = self
            .gid_table()
            .unwrap_or_default()
            .iter()
            .filter(|e| e.port == port)
            .map(|e| format!("{} ({}, {})", e.index, e.gid, e.gid_type))
            .collect();
        Error::InvalidArgument {
            what: "gid index",
            reason: format!(
                "port {port} of {} has no GID at index {index}; valid: {}",
                self.name(),
                if valid.is_empty() {
                    "none".to_owned()
                } else {
                    valid.join(", ")
                }
            ),
        }
    }

    /// The GID index to use on `port` when the caller names none: `None` on
    /// InfiniBand (no GRH needed within a subnet); on RoCE (Ethernet link
    /// layer) the first RoCE v2 IPv4-mapped GID, else the first RoCE v2 GID,
    /// else the first RoCE v1 one (what `-g`/`-x` usually select). An
    /// Ethernet port without any GID (no IP address on its netdev) is an error.
    pub fn default_gid_index(&self, port: u8) -> Result<Option<u8>> {
        if self.port_facts(port)?.link_layer != LinkLayer::Ethernet {
            return Ok(None);
        }
        let table: Vec<GidEntry> = self
            .gid_table()?
            .into_iter()
            .filter(|e| e.port == port)
            .collect();
        let v2 = |e: &&GidEntry| e.gid_type == crate::device::GidType::RoceV2;
        table
            .iter()
            .filter(v2)
            .find(|e| e.gid.is_ipv4_mapped())
            .or_else(|| table.iter().find(v2))
            .or_else(|| table.first())
            .map(|e| Some(e.index))
            .ok_or_else(|| Error::InvalidArgument {
                what: "gid index",
                reason: format!(
                    "port {port} of {} is RoCE but has no GID: give its network interface an IP address",
                    self.name()
                ),
            })
    }

    /// One GID table entry with its type and netdev (`ibv_query_gid_ex`).
    #[doc(alias = "ibv_query_gid_ex")]
    pub fn query_gid_entry(&self, port: u8, index: u8) -> Result<GidEntry> {
        let mut e = MaybeUninit::<ffi::ibv_gid_entry>::zeroed();
        // SAFETY: valid context and out-pointer; flags must be 0.
        let done = verb!(rc: unsafe {
            ffi::ibv_query_gid_ex(
                self.as_raw(),
                u32::from(port),
                index.into(),
                e.as_mut_ptr(),
                0,
            )?
        });
        if let Err(failed) = done {
            // A port that does not exist says so first (as `query_gid`).
            self.query_port(port)?;
            return Err(Error::InvalidArgument {
                what: "gid index",
                reason: format!(
                    "port {port} of {} has no valid GID at index {index} ({})",
                    self.name(),
                    failed.source
                ),
            });
        }
        // SAFETY: filled by the call.
        let e = unsafe { e.assume_init() };
        gid_entry(&e).ok_or_else(|| self.no_gid(port, index))
    }

    /// Every valid GID of every port (`ibv_query_gid_table`), in table order.
    #[doc(alias = "ibv_query_gid_table")]
    pub fn gid_table(&self) -> Result<Vec<GidEntry>> {
        let attr = self.query_device()?;
        let mut cap = 0usize;
        for p in 1..=attr.phys_port_cnt {
            cap += usize::try_from(self.query_port(p)?.gid_tbl_len).unwrap_or(0);
        }
        let mut entries = vec![ffi::ibv_gid_entry::default(); cap.max(1)];
        // SAFETY: entries has room for `len` entries; flags must be 0.
        let n = verb!(count: unsafe {
            ffi::ibv_query_gid_table(self.as_raw(), entries.as_mut_ptr(), entries.len(), 0)?
        })?;
        entries.truncate(n as usize);
        // Indices past 255 cannot be named in an address vector: left out.
        Ok(entries.iter().filter_map(gid_entry).collect())
    }
}

fn gid_entry(e: &ffi::ibv_gid_entry) -> Option<GidEntry> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf is IF_NAMESIZE bytes as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(e.ndev_ifindex, buf.as_mut_ptr()) };
    let netdev = (e.ndev_ifindex != 0 && !p.is_null()).then(|| device::carray(&buf));
    Some(GidEntry {
        index: u8::try_from(e.gid_index).ok()?,
        port: u8::try_from(e.port_num).unwrap_or(0),
        gid: Gid::from_ffi(&e.gid),
        gid_type: GidType::from_raw(e.gid_type),
        netdev,
    })
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.name())
            .finish()
    }
}

/// Device attributes, as `ibv_devinfo -v` prints them (`ibv_device_attr_ex`).
#[doc(alias("ibv_device_attr_ex", "ibv_device_attr"))]
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceAttr {
    /// Firmware version string.
    pub fw_ver: String,
    /// Node GUID, host byte order.
    pub node_guid: u64,
    /// System image GUID, host byte order.
    pub sys_image_guid: u64,
    /// Largest registrable region, bytes.
    pub max_mr_size: u64,
    /// Supported page sizes (bit mask).
    pub page_size_cap: u64,
    /// IEEE vendor ID.
    pub vendor_id: u32,
    /// Vendor part ID.
    pub vendor_part_id: u32,
    /// Hardware version.
    pub hw_ver: u32,
    /// Max QPs.
    pub max_qp: i32,
    /// Max outstanding WRs per queue.
    pub max_qp_wr: i32,
    /// `IBV_DEVICE_*` capability flags.
    pub device_cap_flags: u32,
    /// Max scatter/gather entries per WR (non-RD).
    pub max_sge: i32,
    /// Max SGEs per RDMA READ.
    pub max_sge_rd: i32,
    /// Max CQs.
    pub max_cq: i32,
    /// Max CQ entries per CQ.
    pub max_cqe: i32,
    /// Max MRs.
    pub max_mr: i32,
    /// Max PDs.
    pub max_pd: i32,
    /// Max outstanding RDMA READ/atomic per QP as target.
    pub max_qp_rd_atom: i32,
    /// Max per EE context as target.
    pub max_ee_rd_atom: i32,
    /// Max resources for RDMA READ/atomic as target.
    pub max_res_rd_atom: i32,
    /// Max outstanding RDMA READ/atomic per QP as initiator.
    pub max_qp_init_rd_atom: i32,
    /// Max per EE as initiator.
    pub max_ee_init_rd_atom: i32,
    /// Atomic support.
    pub atomic_cap: AtomicCap,
    /// Max EE contexts.
    pub max_ee: i32,
    /// Max RDDs.
    pub max_rdd: i32,
    /// Max memory windows.
    pub max_mw: i32,
    /// Max raw IPv6 QPs.
    pub max_raw_ipv6_qp: i32,
    /// Max raw Ethertype QPs.
    pub max_raw_ethy_qp: i32,
    /// Max multicast groups.
    pub max_mcast_grp: i32,
    /// Max QPs per multicast group.
    pub max_mcast_qp_attach: i32,
    /// Max QPs attached to multicast groups in total.
    pub max_total_mcast_qp_attach: i32,
    /// Max address handles.
    pub max_ah: i32,
    /// Max FMRs.
    pub max_fmr: i32,
    /// Max maps per FMR.
    pub max_map_per_fmr: i32,
    /// Max SRQs.
    pub max_srq: i32,
    /// Max WRs per SRQ.
    pub max_srq_wr: i32,
    /// Max SGEs per SRQ WR.
    pub max_srq_sge: i32,
    /// Max partition keys.
    pub max_pkeys: u16,
    /// Local CA ack delay.
    pub local_ca_ack_delay: u8,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
    /// On-demand paging general caps (`IBV_ODP_*`).
    pub odp_general_caps: u64,
    /// ODP caps for RC.
    pub odp_rc_caps: u32,
    /// ODP caps for UC.
    pub odp_uc_caps: u32,
    /// ODP caps for UD.
    pub odp_ud_caps: u32,
    /// Completion timestamp mask (0: no timestamps).
    pub completion_timestamp_mask: u64,
    /// HCA core clock, kHz.
    pub hca_core_clock: u64,
    /// Extended capability flags.
    pub device_cap_flags_ex: u64,
    /// Max device memory, bytes.
    pub max_dm_size: u64,
    /// Max CQ moderation count.
    pub max_cq_count: u16,
    /// Max CQ moderation period, µs.
    pub max_cq_period: u16,
    /// Port count from the extended query.
    pub phys_port_cnt_ex: u32,
}

impl DeviceAttr {
    /// `IB_UVERBS_DEVICE_ATOMIC_WRITE` of `device_cap_flags_ex` (Linux's
    /// `ib_user_ioctl_verbs.h`; rdma-core 44's headers do not name it yet).
    pub const ATOMIC_WRITE_FLAG: u64 = 1 << 40;

    /// Whether the device executes ATOMIC_WRITE (an 8-byte write the responder
    /// makes visible at once, [`SendWr::atomic_write`](crate::qp::SendWr::atomic_write)):
    /// rxe from Linux 6.2 on.
    pub fn atomic_write(&self) -> bool {
        self.device_cap_flags_ex & Self::ATOMIC_WRITE_FLAG != 0
    }

    /// `IB_UVERBS_DEVICE_FLUSH_GLOBAL` of `device_cap_flags_ex` (Linux 6.2's uapi).
    pub const FLUSH_GLOBAL_FLAG: u64 = ffi::IB_UVERBS_DEVICE_FLUSH_GLOBAL;
    /// `IB_UVERBS_DEVICE_FLUSH_PERSISTENT` of `device_cap_flags_ex` (Linux 6.2's uapi).
    pub const FLUSH_PERSISTENT_FLAG: u64 = ffi::IB_UVERBS_DEVICE_FLUSH_PERSISTENT;

    /// Whether the device executes FLUSH to the global visibility point
    /// ([`SendWr::flush`](crate::qp::SendWr::flush) with
    /// [`FlushPlacement::Global`](crate::qp::FlushPlacement::Global)): rxe from Linux 6.2 on.
    pub fn flush_global(&self) -> bool {
        self.device_cap_flags_ex & Self::FLUSH_GLOBAL_FLAG != 0
    }

    /// Whether the device executes FLUSH to persistence
    /// ([`FlushPlacement::Persistent`](crate::qp::FlushPlacement::Persistent)): rxe from Linux
    /// 6.2 on, for MRs on persistent memory.
    pub fn flush_persistent(&self) -> bool {
        self.device_cap_flags_ex & Self::FLUSH_PERSISTENT_FLAG != 0
    }

    /// The placement types the device reports, as `ibv_placement_type` bits.
    pub(crate) fn flush_placements(&self) -> u8 {
        (if self.flush_global() {
            ffi::IBV_FLUSH_GLOBAL
        } else {
            0
        }) | (if self.flush_persistent() {
            ffi::IBV_FLUSH_PERSISTENT
        } else {
            0
        })
    }

    fn from_ffi(a: &ffi::ibv_device_attr_ex) -> DeviceAttr {
        let o = &a.orig_attr;
        DeviceAttr {
            fw_ver: device::carray(&o.fw_ver),
            node_guid: u64::from_be(o.node_guid),
            sys_image_guid: u64::from_be(o.sys_image_guid),
            max_mr_size: o.max_mr_size,
            page_size_cap: o.page_size_cap,
            vendor_id: o.vendor_id,
            vendor_part_id: o.vendor_part_id,
            hw_ver: o.hw_ver,
            max_qp: o.max_qp,
            max_qp_wr: o.max_qp_wr,
            device_cap_flags: o.device_cap_flags,
            max_sge: o.max_sge,
            max_sge_rd: o.max_sge_rd,
            max_cq: o.max_cq,
            max_cqe: o.max_cqe,
            max_mr: o.max_mr,
            max_pd: o.max_pd,
            max_qp_rd_atom: o.max_qp_rd_atom,
            max_ee_rd_atom: o.max_ee_rd_atom,
            max_res_rd_atom: o.max_res_rd_atom,
            max_qp_init_rd_atom: o.max_qp_init_rd_atom,
            max_ee_init_rd_atom: o.max_ee_init_rd_atom,
            atomic_cap: AtomicCap::from_raw(o.atomic_cap),
            max_ee: o.max_ee,
            max_rdd: o.max_rdd,
            max_mw: o.max_mw,
            max_raw_ipv6_qp: o.max_raw_ipv6_qp,
            max_raw_ethy_qp: o.max_raw_ethy_qp,
            max_mcast_grp: o.max_mcast_grp,
            max_mcast_qp_attach: o.max_mcast_qp_attach,
            max_total_mcast_qp_attach: o.max_total_mcast_qp_attach,
            max_ah: o.max_ah,
            max_fmr: o.max_fmr,
            max_map_per_fmr: o.max_map_per_fmr,
            max_srq: o.max_srq,
            max_srq_wr: o.max_srq_wr,
            max_srq_sge: o.max_srq_sge,
            max_pkeys: o.max_pkeys,
            local_ca_ack_delay: o.local_ca_ack_delay,
            phys_port_cnt: o.phys_port_cnt,
            odp_general_caps: a.odp_caps.general_caps,
            odp_rc_caps: a.odp_caps.per_transport_caps.rc_odp_caps,
            odp_uc_caps: a.odp_caps.per_transport_caps.uc_odp_caps,
            odp_ud_caps: a.odp_caps.per_transport_caps.ud_odp_caps,
            completion_timestamp_mask: a.completion_timestamp_mask,
            hca_core_clock: a.hca_core_clock,
            device_cap_flags_ex: a.device_cap_flags_ex,
            max_dm_size: a.max_dm_size,
            max_cq_count: a.cq_mod_caps.max_cq_count,
            max_cq_period: a.cq_mod_caps.max_cq_period,
            phys_port_cnt_ex: a.phys_port_cnt_ex,
        }
    }
}

/// Port attributes (`ibv_port_attr`).
#[doc(alias = "ibv_port_attr")]
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PortAttr {
    /// Logical state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU in use; the default path MTU for connections.
    pub active_mtu: Mtu,
    /// GID table length.
    pub gid_tbl_len: i32,
    /// `IBV_PORT_*` capability flags.
    pub port_cap_flags: u32,
    /// Max message size.
    pub max_msg_sz: u32,
    /// Bad P_Key counter.
    pub bad_pkey_cntr: u32,
    /// Q_Key violation counter.
    pub qkey_viol_cntr: u32,
    /// P_Key table length.
    pub pkey_tbl_len: u16,
    /// Base LID (0 on RoCE).
    pub lid: u16,
    /// Subnet manager LID.
    pub sm_lid: u16,
    /// LID mask control.
    pub lmc: u8,
    /// Max virtual lanes.
    pub max_vl_num: u8,
    /// Subnet manager SL.
    pub sm_sl: u8,
    /// Subnet propagation delay.
    pub subnet_timeout: u8,
    /// Init type reply.
    pub init_type_reply: u8,
    /// Active link width (encoded as the kernel reports it).
    pub active_width: u8,
    /// Active link speed (encoded).
    pub active_speed: u8,
    /// Physical port state (5 = LinkUp).
    pub phys_state: u8,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Port flags.
    pub flags: u8,
    /// More capability flags.
    pub port_cap_flags2: u16,
}

impl PortAttr {
    fn from_ffi(a: &ffi::ibv_port_attr) -> PortAttr {
        PortAttr {
            state: PortState::from_raw(a.state),
            max_mtu: Mtu::from_raw(a.max_mtu),
            active_mtu: Mtu::from_raw(a.active_mtu),
            gid_tbl_len: a.gid_tbl_len,
            port_cap_flags: a.port_cap_flags,
            max_msg_sz: a.max_msg_sz,
            bad_pkey_cntr: a.bad_pkey_cntr,
            qkey_viol_cntr: a.qkey_viol_cntr,
            pkey_tbl_len: a.pkey_tbl_len,
            lid: a.lid,
            sm_lid: a.sm_lid,
            lmc: a.lmc,
            max_vl_num: a.max_vl_num,
            sm_sl: a.sm_sl,
            subnet_timeout: a.subnet_timeout,
            init_type_reply: a.init_type_reply,
            active_width: a.active_width,
            active_speed: a.active_speed,
            phys_state: a.phys_state,
            link_layer: LinkLayer::from_raw(a.link_layer),
            flags: a.flags,
            port_cap_flags2: a.port_cap_flags2,
        }
    }
}
