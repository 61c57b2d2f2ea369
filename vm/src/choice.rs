//! Which guest to boot: the Debian kernel ([`GuestKernel`]) and the software RDMA provider
//! it brings up ([`Provider`]), chosen by flag or environment variable.

use std::fmt;

use crate::{Error, Result};

/// Environment variable choosing the guest kernel (see [`GuestKernel::parse`]).
pub const KERNEL_ENV: &str = "RDMA_VERBS_VM_KERNEL";
/// Environment variable choosing the provider (see [`Provider::parse`]).
pub const PROVIDER_ENV: &str = "RDMA_VERBS_VM_PROVIDER";

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

/// A kernel and a provider: one guest configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Choice {
    /// The guest kernel.
    pub kernel: GuestKernel,
    /// The provider it brings up.
    pub provider: Provider,
}

impl Choice {
    /// The choice [`KERNEL_ENV`] and [`PROVIDER_ENV`] make (defaults where unset).
    pub fn from_env() -> Result<Self> {
        Ok(Self {
            kernel: GuestKernel::from_env()?,
            provider: Provider::from_env()?,
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
    }
}
