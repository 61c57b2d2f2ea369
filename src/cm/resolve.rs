//! Address and route resolution on a [`CmId`].

use super::*;

impl CmId {
    /// Resolves `dst` to a device, port and (RoCE) next-hop MAC
    /// (`rdma_resolve_addr`, waiting for ADDR_RESOLVED), optionally from
    /// `src`. The kernel gives up after `timeout` (ADDR_ERROR, status
    /// -ETIMEDOUT); this call returns at the latest 2 s after that.
    #[doc(alias = "rdma_resolve_addr")]
    pub fn resolve_addr(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<()> {
        let _own = {
            let _g = self.inner.lock();
            self.inner.refuse_if_waiting()?;
            self.start_resolve_addr_locked(src, dst, timeout)?;
            BlockingWaitGuard::mark(&self.inner)
        };
        self.inner.expect(Awaited::ADDR_RESOLVED, timeout).map(drop)
    }

    /// Calls `rdma_resolve_addr` (ADDR_RESOLVED or ADDR_ERROR follows). Call
    /// with the lock held.
    pub(super) fn start_resolve_addr_locked(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<()> {
        let mut d = RawAddr::new(dst);
        let mut s = src.map(RawAddr::new);
        let sp = s.as_mut().map_or(std::ptr::null_mut(), RawAddr::as_ptr);
        // SAFETY: valid id under its lock; the addresses are full sockaddrs.
        let rc = unsafe { ffi::rdma_resolve_addr(self.inner.id(), sp, d.as_ptr(), ms(timeout)) };
        if rc != 0 {
            let e = last_errno();
            let hint = match e.raw_os_error() {
                Some(libc::ENETUNREACH) | Some(libc::EHOSTUNREACH) => {
                    Some(format!("there is no route to {}", dst.ip()))
                }
                Some(libc::ENODEV) | Some(libc::EADDRNOTAVAIL) => Some(format!(
                    "the route to {} does not go through an RDMA device",
                    dst.ip()
                )),
                _ => None,
            };
            return Err(Error::Verb {
                verb: "rdma_resolve_addr",
                source: e,
                hint,
            });
        }
        Ok(())
    }

    /// Resolves the route to the resolved address (`rdma_resolve_route`,
    /// waiting for ROUTE_RESOLVED; returns at the latest 2 s after `timeout`).
    #[doc(alias = "rdma_resolve_route")]
    pub fn resolve_route(&self, timeout: Duration) -> Result<()> {
        let _own = {
            let _g = self.inner.lock();
            self.inner.refuse_if_waiting()?;
            self.start_resolve_route_locked(timeout)?;
            BlockingWaitGuard::mark(&self.inner)
        };
        self.inner
            .expect(Awaited::ROUTE_RESOLVED, timeout)
            .map(drop)
    }

    /// Calls `rdma_resolve_route` (ROUTE_RESOLVED or ROUTE_ERROR follows).
    /// Call with the lock held.
    pub(super) fn start_resolve_route_locked(&self, timeout: Duration) -> Result<()> {
        // librdmacm reads `id->verbs->device` without a check: NULL until an
        // address resolution (or a bind to a device's address) succeeded.
        // SAFETY: valid id under its lock (caller); verbs is a plain field.
        if unsafe { (*self.inner.id()).verbs }.is_null() {
            return Err(Error::InvalidArgument {
                what: "rdma_cm id",
                reason: "its route cannot be resolved before its address: call resolve_addr \
                         (and wait for it to succeed) first, or use resolve"
                    .into(),
            });
        }
        // SAFETY: valid id under its lock (caller), bound to a device.
        let rc = unsafe { ffi::rdma_resolve_route(self.inner.id(), ms(timeout)) };
        if rc != 0 {
            let source = last_errno();
            let hint = (source.raw_os_error() == Some(libc::ENODEV)).then(|| {
                "the address resolved to an interface without RDMA (a loopback address such as \
                 127.0.0.1 or ::1?): use an address of the RDMA interface itself"
                    .to_owned()
            });
            return Err(Error::Verb {
                verb: "rdma_resolve_route",
                source,
                hint,
            });
        }
        Ok(())
    }

    /// [`resolve_addr`](CmId::resolve_addr) then [`resolve_route`](CmId::resolve_route)
    /// (`rdma_resolve_addr`, `rdma_resolve_route`),
    /// each with `timeout`: what a client does before [`create_qp`](CmId::create_qp).
    #[doc(alias = "rdma_resolve_addr")]
    #[doc(alias = "rdma_resolve_route")]
    pub fn resolve(&self, dst: SocketAddr, timeout: Duration) -> Result<()> {
        self.resolve_addr(None, dst, timeout)?;
        self.resolve_route(timeout)
    }
}
