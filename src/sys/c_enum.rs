//! A macro for Rust enums mirroring C enums, with an `Unknown` catch-all so a
//! value the headers did not know about never panics or becomes UB.

/// Declares `enum $name { $variant, ..., Unknown(raw) }` with `from_raw`,
/// `as_raw`, `name()` (rdma-core's spelling) and `Display`.
macro_rules! c_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident : $raw:ty {
            $( $(#[$vmeta:meta])* $variant:ident = $value:path => $text:literal, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        $vis enum $name {
            $( $(#[$vmeta])* $variant, )*
            /// A value this crate does not know (newer rdma-core or kernel).
            Unknown($raw),
        }

        impl $name {
            /// Converts from the C value; unknown values map to `Unknown`.
            #[allow(clippy::unnecessary_cast)]
            #[inline]
            pub fn from_raw(raw: $raw) -> Self {
                $( if raw == $value as $raw { return $name::$variant; } )*
                $name::Unknown(raw)
            }

            /// The C value.
            #[allow(clippy::unnecessary_cast)]
            #[inline]
            pub fn as_raw(self) -> $raw {
                match self {
                    $( $name::$variant => $value as $raw, )*
                    $name::Unknown(raw) => raw,
                }
            }

            /// The name rdma-core's tools print for this value.
            pub fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )*
                    $name::Unknown(_) => "UNKNOWN",
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                match self {
                    $name::Unknown(raw) => write!(f, "UNKNOWN({raw})"),
                    other => f.write_str(other.name()),
                }
            }
        }
    };
}

pub(crate) use c_enum;
