//~ ERROR E0597 does not live long enough
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::qp::Rts;
use rdma_verbs::{AccessFlags, Cq, Pd, PreparedSends, Qp, Rc, RemoteMr, Result, ScopedSend, Src};

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
