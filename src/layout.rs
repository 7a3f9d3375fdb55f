//! On-disk and wire structures declared once, as a field list: [`layout!`]
//! makes the struct, its size, bounded decode and encode, and compile-time
//! checks that the fields lie in order inside the size. A field is
//! little-endian (`u16`, `u32`, `u64`, `[u32; N]`), big-endian ([`Be16`],
//! [`Be32`], [`Be64`]), bytes (`[u8; N]`) or a structure of its own that
//! implements [`Field`] (a space map root in a superblock). A read past the buffer never panics: it is an
//! error naming the structure and the field.
//!
//! Written here rather than taken from a crate: `zerocopy`'s little-endian
//! types would need every struct packed to the byte with explicit padding
//! fields and conversions at every use, and `binrw`/`deku` bring a proc-macro
//! and a reader abstraction for what is, in every format dmkit speaks, a fixed
//! list of integers at fixed offsets (the same reason thin-provisioning-tools
//! reads its superblocks by hand).

use std::fmt;

/// A field type: how many bytes it takes and how it is read and written.
pub trait Field: Copy {
    const LEN: usize;
    /// Read from `b`, exactly `LEN` bytes.
    fn get(b: &[u8]) -> Self;
    /// Write into `b`, exactly `LEN` bytes.
    fn put(self, b: &mut [u8]);
}

macro_rules! le_field {
    ($($t:ty),*) => {$(
        impl Field for $t {
            const LEN: usize = std::mem::size_of::<$t>();
            fn get(b: &[u8]) -> $t {
                let mut w = [0u8; std::mem::size_of::<$t>()];
                w.copy_from_slice(b);
                <$t>::from_le_bytes(w)
            }
            fn put(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}
le_field!(u8, u16, u32, u64);

macro_rules! be_field {
    ($($name:ident $t:ty),*) => {$(
        /// A big-endian field (network order: NBD's headers).
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub $t);
        impl Field for $name {
            const LEN: usize = std::mem::size_of::<$t>();
            fn get(b: &[u8]) -> $name {
                let mut w = [0u8; std::mem::size_of::<$t>()];
                w.copy_from_slice(b);
                $name(<$t>::from_be_bytes(w))
            }
            fn put(self, b: &mut [u8]) {
                b.copy_from_slice(&self.0.to_be_bytes());
            }
        }
    )*};
}
be_field!(Be16 u16, Be32 u32, Be64 u64);

impl<const N: usize> Field for [u8; N] {
    const LEN: usize = N;
    fn get(b: &[u8]) -> [u8; N] {
        let mut w = [0u8; N];
        w.copy_from_slice(b);
        w
    }
    fn put(self, b: &mut [u8]) {
        b.copy_from_slice(&self);
    }
}

/// An array of little-endian words (dm-cache's policy version).
impl<const N: usize> Field for [u32; N] {
    const LEN: usize = 4 * N;
    fn get(b: &[u8]) -> [u32; N] {
        let mut w = [0u32; N];
        for (v, c) in w.iter_mut().zip(b.chunks_exact(4)) {
            *v = u32::get(c);
        }
        w
    }
    fn put(self, b: &mut [u8]) {
        for (v, c) in self.iter().zip(b.chunks_exact_mut(4)) {
            v.put(c);
        }
    }
}

/// A field that lies past the end of the bytes given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutError {
    /// The structure (`"log-writes super"`).
    pub what: &'static str,
    /// The field (`"sectorsize"`).
    pub field: &'static str,
    /// Its first byte and length.
    pub at: usize,
    pub len: usize,
    /// How many bytes there were.
    pub have: usize,
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: field {} (bytes {}..{}) lies past the {} bytes there are",
            self.what,
            self.field,
            self.at,
            self.at + self.len,
            self.have
        )
    }
}

impl std::error::Error for LayoutError {}

/// Field `field` of `what`, a `T` at byte `at` of `b`.
pub fn get<T: Field>(b: &[u8], what: &'static str, field: &'static str, at: usize) -> Result<T, LayoutError> {
    match b.get(at..at.saturating_add(T::LEN)) {
        Some(s) if s.len() == T::LEN => Ok(T::get(s)),
        _ => Err(LayoutError {
            what,
            field,
            at,
            len: T::LEN,
            have: b.len(),
        }),
    }
}

/// Write field `field` of `what`, a `T`, at byte `at` of `b`.
pub fn put<T: Field>(
    b: &mut [u8],
    what: &'static str,
    field: &'static str,
    at: usize,
    v: T,
) -> Result<(), LayoutError> {
    let have = b.len();
    match b.get_mut(at..at.saturating_add(T::LEN)) {
        Some(s) if s.len() == T::LEN => {
            v.put(s);
            Ok(())
        }
        _ => Err(LayoutError {
            what,
            field,
            at,
            len: T::LEN,
            have,
        }),
    }
}

/// Declare a structure by its fields and their byte offsets:
///
/// ```ignore
/// layout! {
///     /// The log's super.
///     pub struct SuperFields("log-writes super", 28) {
///         pub magic: u64 = 0,
///         pub version: u64 = 8,
///         pub nr_entries: u64 = 16,
///         pub sectorsize: u32 = 24,
///     }
/// }
/// ```
///
/// gives the struct (`Clone, Copy, Debug, PartialEq, Eq`), `SIZE`,
/// `decode(&[u8]) -> Result<Self, LayoutError>` (reads nothing past the
/// buffer; the bytes between fields are not looked at), `from_array(&[u8;
/// N])` for an array known when compiled to hold it, `encode_into(&mut
/// [u8])` (writes the fields only, leaving the bytes between them as they
/// are) and `encode() -> [u8; SIZE]` (zeroes between them), and checks at
/// compile time that each field starts at or after the end of the one
/// before it and the last ends within `SIZE`.
#[macro_export]
macro_rules! layout {
    ($(#[$m:meta])* $vis:vis struct $name:ident($what:literal, $size:expr) {
        $($(#[$fm:meta])* $fvis:vis $field:ident : $ty:ty = $off:expr),* $(,)?
    }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        $vis struct $name {
            $($(#[$fm])* $fvis $field: $ty),*
        }

        const _: () = {
            let mut end = 0usize;
            $(
                assert!($off >= end, concat!($what, ": field ", stringify!($field), " overlaps the one before it"));
                end = $off + <$ty as $crate::layout::Field>::LEN;
            )*
            assert!(end <= $size, concat!($what, ": the fields run past its size"));
        };

        impl $name {
            /// Bytes the structure takes.
            #[allow(dead_code)]
            pub const SIZE: usize = $size;

            /// The fields from `b`; Err names the first that lies past its end.
            #[allow(dead_code)]
            pub fn decode(b: &[u8]) -> ::std::result::Result<$name, $crate::layout::LayoutError> {
                Ok($name {
                    $($field: $crate::layout::get(b, $what, stringify!($field), $off)?),*
                })
            }

            /// The fields from an array at least as long as the structure (a
            /// whole metadata block): nothing to fail, checked when compiled.
            #[allow(dead_code)]
            pub fn from_array<const N: usize>(b: &[u8; N]) -> $name {
                const { assert!(N >= $size, concat!($what, ": the array is shorter than the structure")) };
                $name {
                    $($field: <$ty as $crate::layout::Field>::get(
                        &b[$off..$off + <$ty as $crate::layout::Field>::LEN],
                    )),*
                }
            }

            /// Write the fields into `b` (the bytes between them untouched).
            #[allow(dead_code)]
            pub fn encode_into(&self, b: &mut [u8]) -> ::std::result::Result<(), $crate::layout::LayoutError> {
                $($crate::layout::put(b, $what, stringify!($field), $off, self.$field)?;)*
                Ok(())
            }

            /// The structure's bytes, zeroes between the fields.
            #[allow(dead_code)]
            pub fn encode(&self) -> [u8; $size] {
                let mut b = [0u8; $size];
                $(<$ty as $crate::layout::Field>::put(
                    self.$field,
                    &mut b[$off..$off + <$ty as $crate::layout::Field>::LEN],
                );)*
                b
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::layout! {
        /// A test structure with a gap and a big-endian field.
        struct T("test header", 24) {
            a: u64 = 0,
            b: u32 = 8,
            c: Be32 = 16,
            d: [u8; 2] = 20,
        }
    }

    #[test]
    fn round_trip_and_a_short_buffer_names_the_field() {
        let t = T {
            a: 0x0102_0304_0506_0708,
            b: 9,
            c: Be32(0x0a0b_0c0d),
            d: [1, 2],
        };
        let b = t.encode();
        assert_eq!(&b[0..8], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&b[16..20], &[0x0a, 0x0b, 0x0c, 0x0d]);
        assert_eq!(&b[12..16], &[0; 4], "the gap is zero");
        assert_eq!(T::decode(&b), Ok(t));
        let e = T::decode(&b[..18]).unwrap_err();
        assert_eq!((e.field, e.at, e.have), ("c", 16, 18));
        assert_eq!(
            e.to_string(),
            "test header: field c (bytes 16..20) lies past the 18 bytes there are"
        );
        let mut short = [0u8; 10];
        assert_eq!(t.encode_into(&mut short).unwrap_err().field, "b");
    }
}
