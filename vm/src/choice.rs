//! Which guest to boot: the Debian kernel ([`GuestKernel`]), the software RDMA provider it
//! brings up ([`Provider`]) and the rdma-core userland it runs ([`RdmaCore`]), chosen by flag
//! or environment variable.

use std::fmt;

use crate::{Error, Result};

/// Environment variable choosing the guest kernel (see [`GuestKernel::parse`]).
pub const KERNEL_ENV: &str = "RDMA_VERBS_VM_KERNEL";
/// Environment variable choosing the provider (see [`Provider::parse`]).
pub const PROVIDER_ENV: &str = "RDMA_VERBS_VM_PROVIDER";
/// Environment variable choosing the guest's rdma-core (see [`RdmaCore::parse`]).
pub const RDMA_CORE_ENV: &str = "RDMA_VERBS_VM_RDMA_CORE";

/// The Debian kernel the guest boots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GuestKernel {
    /// Debian 12's `linux-image-amd64` from the host's own apt sources (6.1): the default.
    #[default]
    Stable,
    /// The newest kernel of `bookworm-backports` (6.12 today), fetched through a private apt
    /// configuration under the cache directory's `bpo/` (the host's sources are untouched).
    Backports,
}

impl GuestKernel {
    /// Parses `6.1` (also `stable`, `bookworm`, `default`) or `6.12` (also `bpo`,
    /// `backports`, `bookworm-backports`).
    pub fn parse(value: &str) -> Result<Self> {
        match value.trim() {
            "6.1" | "stable" | "bookworm" | "default" => Ok(Self::Stable),
            "6.12" | "bpo" | "backports" | "bookworm-backports" => Ok(Self::Backports),
            other => Err(Error::usage(format!(
                "unknown guest kernel {other:?}: expected 6.1 (Debian 12's, the default) or \
                 6.12 (bookworm-backports)"
            ))),
        }
    }

    /// The kernel [`KERNEL_ENV`] names, else the default.
    pub fn from_env() -> Result<Self> {
        match std::env::var(KERNEL_ENV) {
            Ok(v) if !v.trim().is_empty() => {
                Self::parse(&v).map_err(|e| Error::usage(format!("{KERNEL_ENV}: {e}")))
            }
            _ => Ok(Self::default()),
        }
    }

    /// The subdirectory of the cache that holds this kernel's artifacts: none for the
    /// default (its files stay where they always were), `bpo` for backports.
    pub fn subdir(self) -> Option<&'static str> {
        match self {
            Self::Stable => None,
            Self::Backports => Some("bpo"),
        }
    }

    /// The Debian suite to fetch the kernel from through a private apt configuration, or
    /// `None` for the host's own sources.
    pub fn suite(self) -> Option<&'static str> {
        match self {
            Self::Stable => None,
            Self::Backports => Some("bookworm-backports"),
        }
    }
}

impl fmt::Display for GuestKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Stable => "6.1",
            Self::Backports => "6.12",
        })
    }
}

/// The software RDMA provider the guest brings up on its network interface.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Provider {
    /// Soft-RoCE (`rdma_rxe`), device `rxe0`: the default.
    #[default]
    Rxe,
    /// Soft-iWARP (`siw`), device `siw0`. Debian's kernels do not build siw, so `setup`
    /// compiles it from the kernel's source package against its headers package.
    Siw,
}

impl Provider {
    /// Parses `rxe` or `siw`.
    pub fn parse(value: &str) -> Result<Self> {
        match value.trim() {
            "rxe" => Ok(Self::Rxe),
            "siw" => Ok(Self::Siw),
            other => Err(Error::usage(format!(
                "unknown provider {other:?}: expected rxe (soft-RoCE, the default) or siw \
                 (soft-iWARP)"
            ))),
        }
    }

    /// The provider [`PROVIDER_ENV`] names, else the default.
    pub fn from_env() -> Result<Self> {
        match std::env::var(PROVIDER_ENV) {
            Ok(v) if !v.trim().is_empty() => {
                Self::parse(&v).map_err(|e| Error::usage(format!("{PROVIDER_ENV}: {e}")))
            }
            _ => Ok(Self::default()),
        }
    }

    /// The `rdma link add` type and device prefix: `rxe` or `siw`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Rxe => "rxe",
            Self::Siw => "siw",
        }
    }

    /// The device the guest creates: `rxe0` or `siw0`.
    pub fn device(self) -> &'static str {
        match self {
            Self::Rxe => "rxe0",
            Self::Siw => "siw0",
        }
    }
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The rdma-core userland (libibverbs, its providers, librdmacm and their tools) the guest's
/// programs load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RdmaCore {
    /// The host's own, which the guest sees through its root (44 on Debian 12): the default.
    #[default]
    Host,
    /// Debian 13's rdma-core 56, unpacked under the cache directory's `rdma-core-56/` with
    /// Debian 13's C library (its libraries need glibc 2.38, newer than Debian 12's) and laid
    /// over the host's files of the same names inside the guest (see
    /// [`setup`](crate::setup)), so every program there, the host's tools included, loads it.
    Deb13,
}

impl RdmaCore {
    /// Parses `host` (also `44`, `default`) or `56` (also `deb13`, `trixie`).
    pub fn parse(value: &str) -> Result<Self> {
        match value.trim() {
            "host" | "44" | "default" => Ok(Self::Host),
            "56" | "deb13" | "trixie" => Ok(Self::Deb13),
            other => Err(Error::usage(format!(
                "unknown rdma-core {other:?}: expected host (the host's, 44 on Debian 12: the \
                 default) or 56 (Debian 13's)"
            ))),
        }
    }

    /// The rdma-core [`RDMA_CORE_ENV`] names, else the default.
    pub fn from_env() -> Result<Self> {
        match std::env::var(RDMA_CORE_ENV) {
            Ok(v) if !v.trim().is_empty() => {
                Self::parse(&v).map_err(|e| Error::usage(format!("{RDMA_CORE_ENV}: {e}")))
            }
            _ => Ok(Self::default()),
        }
    }

    /// The Debian suite its packages come from, or `None` for the host's own.
    pub fn suite(self) -> Option<&'static str> {
        match self {
            Self::Host => None,
            Self::Deb13 => Some("trixie"),
        }
    }
}

impl fmt::Display for RdmaCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Host => "host",
            Self::Deb13 => "56",
        })
    }
}

/// A kernel, a provider and an rdma-core: one guest configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Choice {
    /// The guest kernel.
    pub kernel: GuestKernel,
    /// The provider it brings up.
    pub provider: Provider,
    /// The rdma-core its programs load.
    pub rdma_core: RdmaCore,
}

impl Choice {
    /// The choice [`KERNEL_ENV`], [`PROVIDER_ENV`] and [`RDMA_CORE_ENV`] make (defaults where
    /// unset).
    pub fn from_env() -> Result<Self> {
        Ok(Self {
            kernel: GuestKernel::from_env()?,
            provider: Provider::from_env()?,
            rdma_core: RdmaCore::from_env()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kernels_and_providers() {
        assert_eq!(GuestKernel::parse("6.1").ok(), Some(GuestKernel::Stable));
        assert_eq!(GuestKernel::parse("bpo").ok(), Some(GuestKernel::Backports));
        assert_eq!(
            GuestKernel::parse(" 6.12 ").ok(),
            Some(GuestKernel::Backports)
        );
        assert!(GuestKernel::parse("5.10").is_err_and(|e| e.message.contains("6.12")));
        assert_eq!(Provider::parse("siw").ok(), Some(Provider::Siw));
        assert!(Provider::parse("mlx5").is_err_and(|e| e.message.contains("rxe")));
        assert_eq!(Provider::Siw.device(), "siw0");
        assert_eq!(GuestKernel::Backports.subdir(), Some("bpo"));
        assert_eq!(GuestKernel::Stable.subdir(), None);
        assert_eq!(RdmaCore::parse("56").ok(), Some(RdmaCore::Deb13));
        assert_eq!(RdmaCore::parse("44").ok(), Some(RdmaCore::Host));
        assert!(RdmaCore::parse("50").is_err_and(|e| e.message.contains("56")));
    }
}
