//! The crate's one error type.
//!
//! Every failing verb names itself, carries the errno, and where a common cause
//! is known, a hint that says what to do about it.

use std::fmt;
use std::io;

use crate::sys::call::VerbFailure;
use crate::values::WcStatus;

#[cfg(feature = "gdr")]
pub(crate) mod gdr;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in rdma-verbs.
///
/// `Debug` prints the same text as `Display`, advice included, so that a `main`
/// returning [`Result`] says what to do; match the variant for its fields.
#[non_exhaustive]
#[derive(thiserror::Error)]
pub enum Error {
    /// A libibverbs / librdmacm call failed.
    #[error("{verb} failed: {source}{}", Hint(hint))]
    Verb {
        /// The C function that failed, e.g. `ibv_reg_mr`.
        verb: &'static str,
        /// The errno it reported.
        source: io::Error,
        /// What to do about it, where a common cause is known.
        hint: Option<String>,
    },

    /// The running kernel has no RDMA support (no `ib_uverbs`).
    #[error(
        "this kernel has no RDMA support (no ib_uverbs; {verb} returned ENOSYS/ENODEV); \
         load rdma_rxe on a kernel that has it, or run the program in a soft-RoCE VM with \
         `rdma-verbs-vm run -- <your program>` (`cargo install --path vm` from a checkout of \
         rdma-verbs: it is not on crates.io yet; as a cargo runner: \
         `runner = [\"rdma-verbs-vm\", \"run\", \"--\"]` under \
         `[target.x86_64-unknown-linux-gnu]` in .cargo/config.toml)"
    )]
    NoRdmaSupport {
        /// The call that revealed it.
        verb: &'static str,
    },

    /// The kernel supports RDMA but there is no device.
    #[error(
        "no RDMA devices found; create a soft-RoCE device with \
         `rdma link add rxe0 type rxe netdev <if>` (needs the rdma_rxe module)"
    )]
    NoDevices,

    /// No device has the requested name.
    #[error("no RDMA device named `{name}` (available: {available})")]
    DeviceNotFound {
        /// The name asked for.
        name: String,
        /// Comma-separated names that do exist.
        available: String,
    },

    /// Memory registration ran into the locked-memory limit.
    #[error(
        "{verb} of {requested} bytes failed: {source}; the locked-memory limit (RLIMIT_MEMLOCK) is {}, \
         raise it with `ulimit -l unlimited` (or memlock in /etc/security/limits.conf, \
         LimitMEMLOCK= for systemd services, --ulimit memlock=-1 for containers)",
        fmt_limit(*limit)
    )]
    MemlockLimit {
        /// `ibv_reg_mr` or a variant.
        verb: &'static str,
        /// Bytes asked for.
        requested: usize,
        /// The soft limit in bytes, `None` when unlimited or unknown.
        limit: Option<u64>,
        /// The errno (ENOMEM or EPERM).
        source: io::Error,
    },

    /// A GID string could not be parsed.
    #[error(
        "invalid GID `{input}`: expected an IPv6 address (`fe80::1`, `::ffff:10.0.0.1`) or 32 hex digits"
    )]
    InvalidGid {
        /// The text that was given.
        input: String,
    },

    /// An argument is out of the range the device or the API accepts.
    ///
    /// Displayed as "`what`: `reason`", e.g. "MR length: an MR needs at least
    /// 1 byte".
    #[error("{what}: {reason}")]
    InvalidArgument {
        /// The argument refused, or the operation that refused it (e.g.
        /// "registering a completion channel with tokio").
        what: &'static str,
        /// Why it is refused and what would be accepted.
        reason: String,
    },

    /// A work request has more scatter/gather entries than allowed.
    #[error(
        "work request has {requested} scatter/gather entries but at most {max} are allowed here: \
         the QP's max_send_sge/max_recv_sge, and at most MAX_SAFE_SGES (4) per request of the \
         ownership-passing path (split the request; raise max_*_sge at QP creation only if it \
         is below 4)"
    )]
    TooManySges {
        /// Entries in the request.
        requested: usize,
        /// The limit.
        max: usize,
    },

    /// A remote access would fall outside the remote memory region.
    #[error(
        "remote range [{offset}, {offset}+{len}) is outside the remote region of {region_len} bytes"
    )]
    RemoteOutOfBounds {
        /// Offset into the remote region.
        offset: u64,
        /// Bytes accessed.
        len: u64,
        /// Size of the remote region.
        region_len: u64,
    },

    /// A UD datagram larger than one path MTU (UD does not segment).
    #[error(
        "a UD message carries at most one path MTU: {len} bytes exceed the port's active MTU of {max}; \
         split it into datagrams of at most {max} bytes"
    )]
    MessageTooLong {
        /// Payload bytes of the send.
        len: u64,
        /// The largest payload: the port's active MTU.
        max: u32,
    },

    /// The send or receive queue has no free slot: poll completions first.
    #[error(
        "the {queue} queue is full ({depth} work requests outstanding); poll the CQ to retire completions before posting more"
    )]
    QueueFull {
        /// `send` or `recv`.
        queue: &'static str,
        /// Its depth.
        depth: u32,
    },

    /// A [`Cq::scope`](crate::cq::Cq::scope) ended with requests still
    /// outstanding after its drain timeout: their QP was moved to the error
    /// state, which flushed them, before the scope returned.
    #[error(
        "a scope ended with {outstanding} request(s) of QP {qp_num} outstanding after {after:?}; the \
         QP was moved to the error state to flush them (a receive completes only when a message \
         arrives: post only the receives the scope will consume; end each scope's sends with a \
         signaled request and poll its completions: unsignaled sends at the end never produce one; a \
         peer that stopped answering shows as RETRY_EXC_ERR/RNR_RETRY_EXC_ERR completions polled in \
         the scope). Reconnect the QP (to_error, reset) to use it again"
    )]
    ScopeDrained {
        /// The first QP that had to be flushed.
        qp_num: u32,
        /// Its scoped requests outstanding at the timeout.
        outstanding: u64,
        /// The drain timeout (without one, `Duration::MAX`: how long the
        /// scope waited before flushing requests that could not complete:
        /// unsignaled sends, or requests left on a QP in the error state).
        after: std::time::Duration,
    },

    /// A QP's queue (or a shared receive queue) would not fit in its CQ: with
    /// every queue on the CQ full, completions would be lost.
    #[error(
        "the CQ cannot hold the completions of this {queue} queue: it needs {needed} entries and only \
         {free} of the CQ's {depth} are not reserved by other queues on it; create the CQ with more entries \
         (each queue needs its depth: max_send_wr / max_recv_wr), ask for fewer work requests, or poll the CQ \
         empty once so that QPs destroyed with work in flight give their entries back"
    )]
    CqTooSmall {
        /// `send`, `receive` or `shared receive`.
        queue: &'static str,
        /// Entries the queue needs (its depth).
        needed: u64,
        /// Entries not reserved yet.
        free: u64,
        /// The CQ's depth.
        depth: u64,
    },

    /// Signaled work requests were retired by a later completion while their
    /// own completions never reached this poller. Besides an overrun CQ and
    /// `Cq::poll_raw`, a post the provider refused without naming the refused
    /// request (a failed `ibv_wr_complete`, a failed doorbell) leaves
    /// requests counted as posted that may never complete: they are reported
    /// here when a later completion sweeps them.
    #[error(
        "{count} completion(s) were lost: later completions of the same queue arrived without them; the CQ \
         overran (QPs created outside the safe path, or raw-path posts, filled it) or they were consumed by \
         Cq::poll_raw; their buffers were released (or handed back by poll_with_retired or poll_recycling)"
    )]
    CompletionsLost {
        /// How many signaled requests had no completion.
        count: u64,
    },

    /// A QP cannot be reset while work requests are outstanding.
    #[error(
        "{count} {queue} work request(s) are still outstanding; move the QP to ERR (to_error), poll the \
         flushed completions, then reset (requests whose completions Cq::poll_raw consumed, or whose \
         CQ nobody can poll any more because its Cq was dropped, stay outstanding for good: then \
         destroy the QP)"
    )]
    WorkOutstanding {
        /// `send` or `receive`.
        queue: &'static str,
        /// Requests posted and not yet completed.
        count: u64,
    },

    /// A QP created on a shared receive queue has no receive queue of its
    /// own: its receives are posted to the SRQ.
    #[error(
        "QP {qp_num:#x} takes its receives from a shared receive queue: post them with Srq::post_recv"
    )]
    QpUsesSrq {
        /// The QP.
        qp_num: u32,
    },

    /// A QP on a shared receive queue must complete its receives on the CQ
    /// the SRQ was created with (the SRQ's receives are accounted there).
    #[error(
        "the QP's receive CQ is not the CQ its shared receive queue was created with: an SRQ's receives \
         complete on that one CQ (Srq::new's cq); create the QP with it as recv_cq"
    )]
    SrqCqMismatch,

    /// Local access to memory that a remote peer may write at any time.
    #[error(
        "this memory region is remotely writable (REMOTE_WRITE/REMOTE_ATOMIC): a peer may change it at any \
         moment, so no Rust slice of it can be handed out; copy with read_at()/to_vec() instead"
    )]
    RemotelyWritable,

    /// A write to memory the process can only read (a read-only mapping), by
    /// the CPU or, through the access flags asked for, by the NIC.
    #[error(
        "{op} needs write access, but this memory is read-only (e.g. a read-only file mapping); \
         register it with REMOTE_READ and no LOCAL_WRITE, REMOTE_WRITE, REMOTE_ATOMIC or MW_BIND, \
         read it with as_slice()/read_at(), or map it writable (memmap2::MmapMut)"
    )]
    ReadOnlyMemory {
        /// What needed to write, e.g. `Mr::write_at`.
        op: &'static str,
    },

    /// No free huge pages of the size asked for.
    #[error(
        "{len} bytes on {} KiB huge pages need {pages} of them but {free} of {total} reserved are free: \
         reserve more with `echo {} > /sys/kernel/mm/hugepages/hugepages-{}kB/nr_hugepages` as root \
         (2 MiB pages: also /proc/sys/vm/nr_hugepages; 1 GiB pages usually only at boot, \
         with `hugepagesz=1G hugepages=N` on the kernel command line), or ask for the fallback \
         to ordinary pages",
        page_size / 1024, total + pages.saturating_sub(*free), page_size / 1024
    )]
    HugePagesUnavailable {
        /// Bytes asked for.
        len: usize,
        /// The huge page size in bytes.
        page_size: usize,
        /// Huge pages the request needs.
        pages: u64,
        /// Free huge pages of that size (0 when unknown).
        free: u64,
        /// Reserved huge pages of that size (0 when unknown).
        total: u64,
    },

    /// A QP state transition was refused by the kernel.
    #[error(
        "modify_qp {from} -> {to} failed: {source} (attr_mask {mask:#x}: {mask_names}){}",
        Hint(hint)
    )]
    Transition {
        /// State before.
        from: &'static str,
        /// State asked for.
        to: &'static str,
        /// The attribute mask that was sent.
        mask: u32,
        /// The mask's bits by name.
        mask_names: String,
        /// The errno.
        source: io::Error,
        /// What to check.
        hint: Option<String>,
    },

    /// A work completion came back with an error status.
    #[error("work request {wr_id} completed with {status} (vendor error {vendor_err:#x}){}", Hint(&status.hint().map(str::to_owned)))]
    WorkCompletion {
        /// The user's wr_id.
        wr_id: u64,
        /// The status.
        status: WcStatus,
        /// Device-specific detail.
        vendor_err: u32,
    },

    /// A blocking wait ran out of time.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// How long.
        after: std::time::Duration,
    },

    /// An I/O error outside the verbs (e.g. the TCP endpoint exchange).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        source: io::Error,
    },

    /// A peer sent something that does not parse.
    #[error("malformed message from peer: {0}")]
    Protocol(String),

    /// The peer closed the endpoint exchange before sending anything: its own
    /// setup most likely failed (look at its output).
    #[error(
        "the peer closed the connection before sending its endpoint: its own setup most likely \
         failed (a bad GID index, device or port on its side); look at the peer's output"
    )]
    PeerGaveUp,

    /// The peer closed the exchange connection kept open for the life of the RDMA
    /// connection ([`ExchangeStream::peer_closed`](crate::exchange::ExchangeStream::peer_closed))
    /// while this side was still waiting: its process exited or was killed.
    #[error(
        "the peer closed its exchange connection while this side was waiting for {waiting_for}: \
         its process exited or was killed (look at the peer's output)"
    )]
    PeerClosed {
        /// What this side was waiting for.
        waiting_for: &'static str,
    },

    /// An application's own failure, for programs that use this crate's
    /// `Error` as theirs (so that they need not borrow another variant).
    #[error("{0}")]
    Other(String),

    /// The libibverbs loaded at run time is older than this verb (the crate
    /// resolves verbs newer than its oldest supported rdma-core at run time),
    /// or the device's provider lacks the capability (an iWARP device such as
    /// siw has no UD or UC QPs, no immediate data, no atomics, and connects
    /// its QPs through rdma_cm only).
    #[error("{verb} is not supported: {hint}")]
    Unsupported {
        /// The verb or capability, e.g. `ibv_reg_dmabuf_mr`.
        verb: &'static str,
        /// What is missing (which rdma-core added the verb, which provider
        /// lacks the capability) and what to do.
        hint: String,
    },

    /// GPU memory could not be used (CUDA driver missing, no GPUDirect RDMA
    /// path, a failing CUDA call); see [`crate::gdr`].
    #[cfg(feature = "gdr")]
    #[error(transparent)]
    Gdr(#[from] gdr::GdrError),

    /// An rdma_cm operation ended in another event than the one it waits for:
    /// ADDR_ERROR, ROUTE_ERROR, REJECTED, UNREACHABLE, CONNECT_ERROR,
    /// DISCONNECTED, ... (see [`crate::cm`]).
    #[error("{op}: rdma_cm reported {event} (status {status}){}", Hint(hint))]
    CmEvent {
        /// What was being done, e.g. `rdma_connect`.
        op: &'static str,
        /// The event that arrived instead.
        event: crate::values::CmEventKind,
        /// Its status: a negative errno (ADDR_ERROR, UNREACHABLE, ...) or, for
        /// REJECTED on InfiniBand/RoCE, the IB CM reject reason (8: nobody
        /// listens on that port, 28: the peer application rejected).
        status: i32,
        /// Private data that came with it (a REJECTED's reject message).
        private_data: Vec<u8>,
        /// What it usually means.
        hint: Option<String>,
    },
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

struct Hint<'a>(&'a Option<String>);

impl fmt::Display for Hint<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(h) => write!(f, "; hint: {h}"),
            None => Ok(()),
        }
    }
}

fn fmt_limit(limit: Option<u64>) -> String {
    match limit {
        Some(b) => format!("{b} bytes ({} KiB)", b / 1024),
        None => "unlimited or unknown".to_owned(),
    }
}

pub(crate) use crate::sys::call::{errno, last_errno};

impl From<VerbFailure> for Error {
    fn from(f: VerbFailure) -> Error {
        Error::verb(f.verb, f.source)
    }
}

impl Error {
    /// A verb failure with the given errno and no hint.
    pub(crate) fn verb(verb: &'static str, source: io::Error) -> Self {
        let hint = default_hint(verb, &source);
        Error::Verb { verb, source, hint }
    }

    /// The errno behind this error, if it has one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Verb { source, .. }
            | Error::MemlockLimit { source, .. }
            | Error::Transition { source, .. }
            | Error::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

fn default_hint(verb: &'static str, e: &io::Error) -> Option<String> {
    let code = e.raw_os_error()?;
    let h = match code {
        libc::EACCES | libc::EPERM if verb.starts_with("ibv_open") => {
            "no permission on /dev/infiniband/uverbs*; check the device node's mode or run as a member of the rdma group"
        }
        libc::EINVAL if verb == "ibv_create_cq" => {
            "the CQ depth exceeds max_cqe (see query_device())"
        }
        libc::EINVAL if verb == "ibv_create_qp" => {
            "a capability (max_send_wr, max_recv_wr, max_*_sge, max_inline_data) exceeds the device limits (see query_device())"
        }
        libc::EINVAL if verb == "ibv_create_srq" => {
            "max_wr or max_sge exceeds the device limits (max_srq_wr, max_srq_sge: see query_device())"
        }
        libc::ETIMEDOUT if verb == "ibv_create_ah" => {
            "the destination GID's IP address did not answer neighbour discovery (ARP/ND): is the \
             peer up, and is its GID right?"
        }
        libc::ENOMEM if verb == "ibv_create_qp" || verb == "ibv_create_cq" => {
            "the device is out of resources or the requested queue is too deep"
        }
        _ => return None,
    };
    Some(h.to_owned())
}

/// The current RLIMIT_MEMLOCK soft limit in bytes, `None` for unlimited.
pub(crate) fn memlock_limit() -> Option<u64> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the rlimit we own; no other memory is touched.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) };
    (rc == 0 && rl.rlim_cur != libc::RLIM_INFINITY).then_some(rl.rlim_cur)
}

impl From<crate::ffi::MissingSymbol> for Error {
    fn from(m: crate::ffi::MissingSymbol) -> Error {
        Error::Unsupported {
            verb: m.verb,
            hint: m.hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verb_error_names_verb_and_errno() {
        let e = Error::verb("ibv_alloc_pd", errno(libc::ENOMEM));
        let s = e.to_string();
        assert!(s.starts_with("ibv_alloc_pd failed: "), "{s}");
        assert_eq!(e.errno(), Some(libc::ENOMEM));
    }

    #[test]
    fn memlock_error_says_what_to_do() {
        let e = Error::MemlockLimit {
            verb: "ibv_reg_mr",
            requested: 9 << 20,
            limit: Some(8 << 20),
            source: errno(libc::ENOMEM),
        };
        let s = e.to_string();
        assert!(s.contains("ulimit -l"), "{s}");
        assert!(s.contains("8388608 bytes"), "{s}");
        assert!(s.contains("9437184 bytes"), "{s}");
    }

    #[test]
    fn no_rdma_support_points_at_the_vm() {
        let s = Error::NoRdmaSupport {
            verb: "ibv_get_device_list",
        }
        .to_string();
        assert!(
            s.contains("no RDMA support") && s.contains("rdma-verbs-vm run --"),
            "{s}"
        );
        assert!(Error::NoDevices.to_string().contains("rdma link add"));
    }

    #[test]
    fn create_cq_einval_hints_at_max_cqe() {
        let s = Error::verb("ibv_create_cq", errno(libc::EINVAL)).to_string();
        assert!(s.contains("max_cqe"), "{s}");
    }

    #[test]
    fn srq_limits_and_unanswered_neighbours_have_hints() {
        let s = Error::verb("ibv_create_srq", errno(libc::EINVAL)).to_string();
        assert!(s.contains("max_srq_sge"), "{s}");
        let s = Error::verb("ibv_create_ah", errno(libc::ETIMEDOUT)).to_string();
        assert!(s.contains("neighbour discovery"), "{s}");
    }
}
