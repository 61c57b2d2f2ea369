//! The path-selection plan that [`register`](fn@super::register) and
//! [`GpuBuffer`](super::GpuBuffer) share: observe the memory ([`probe`]), decide
//! ([`decide`]), then try the chosen paths in order until one works.

use super::register::probe;
use super::select::{Capabilities, Decision, decide};
use super::{AttemptFailure, DeviceMemory, GdrError};
use crate::error::Result;
use crate::values::gdr::{GdrMode, GdrPath, Missing};

/// The paths to try for one piece of memory, best first, and why better
/// paths are not among them.
pub(crate) struct PathPlan {
    mode: GdrMode,
    caps: Capabilities,
    paths: Vec<GdrPath>,
    skipped: Vec<Missing>,
}

/// The path that worked, what it produced, and what came before it.
pub(crate) struct ChosenPath<T> {
    /// What the working attempt returned.
    pub(crate) value: T,
    /// The path that worked.
    pub(crate) path: GdrPath,
    /// What ruled out the paths the mode would have preferred.
    pub(crate) skipped: Vec<Missing>,
    /// The paths tried before `path`, and why each failed.
    pub(crate) failures: Vec<AttemptFailure>,
}

impl PathPlan {
    /// Observes `mem` and decides for `mode`; [`GdrError::NoPath`] when
    /// [`decide`] refuses.
    pub(crate) fn for_memory(mem: &dyn DeviceMemory, mode: GdrMode) -> Result<PathPlan> {
        let caps = probe(mem);
        match decide(mode, &caps) {
            Decision::Refuse(missing) => Err(GdrError::NoPath {
                mode,
                missing,
                failures: Vec::new(),
            }
            .into()),
            Decision::Try { paths, skipped } => Ok(PathPlan {
                mode,
                caps,
                paths,
                skipped,
            }),
        }
    }

    /// Keeps only the direct paths (dma-buf, peer-mem); [`GdrError::NoPath`]
    /// when none is left.
    pub(crate) fn direct_only(mut self) -> Result<PathPlan> {
        self.paths.retain(|p| p.is_direct());
        if self.paths.is_empty() {
            return Err(GdrError::NoPath {
                mode: self.mode,
                missing: self.skipped,
                failures: Vec::new(),
            }
            .into());
        }
        Ok(self)
    }

    /// Whether a direct path is among those to try.
    pub(crate) fn has_direct(&self) -> bool {
        self.paths.iter().any(|p| p.is_direct())
    }

    /// What was observed.
    pub(crate) fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    /// Tries the paths in order until `attempt` succeeds; when none works,
    /// [`GdrError::NoPath`] with every failure.
    pub(crate) fn first_working<T>(
        self,
        mut attempt: impl FnMut(GdrPath) -> Result<T>,
    ) -> Result<ChosenPath<T>> {
        let mut failures = Vec::new();
        for path in self.paths {
            match attempt(path) {
                Ok(value) => {
                    return Ok(ChosenPath {
                        value,
                        path,
                        skipped: self.skipped,
                        failures,
                    });
                }
                Err(error) => failures.push(AttemptFailure {
                    path,
                    error: Box::new(error),
                    allocation_rdma_capable: self.caps.allocation_rdma_capable,
                }),
            }
        }
        Err(GdrError::NoPath {
            mode: self.mode,
            missing: self.skipped,
            failures,
        }
        .into())
    }
}
