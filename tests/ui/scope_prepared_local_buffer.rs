//~ ERROR E0597 does not live long enough
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::Result;
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::{AccessFlags, RemoteMr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{Qp, Rc, Rts};
use rdma_verbs::qp::scope::{PreparedSends, ScopedSend, Src};

// A prepared list of a buffer created inside the scope: the buffer could be
// dropped while the NIC reads it.
fn f(cq: &mut Cq, qp: &mut Qp<Rc, Rts>, pd: &Pd, remote: RemoteMr) -> Result<()> {
    cq.scope(|s| {
        let mut q = s.attach(qp)?;
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
        let list = PreparedSends::new([ScopedSend::write(0, Src::new(&mr)?, remote, 0)])?;
        q.post_prepared(&list, 1)?;
        Ok(())
    })
}
fn main() {}
