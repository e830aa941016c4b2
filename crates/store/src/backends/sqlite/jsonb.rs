//! Rows of a batch written straight into SQLite's binary JSON, JSONB
//! (<https://sqlite.org/jsonb.html>), for the `jsonb_each($N)` parameters of the
//! SQLite statements.
//!
//! Bound as JSON text, every parameter was parsed into JSONB again by SQLite, on the
//! one writer thread every write of the database waits for; and a string that needed
//! an escape (a stored answer's body is JSON inside a JSON string) was stored escaped,
//! so every `value ->> N` that read it unescaped it once more. Here each string is an
//! element of type TEXTRAW, whose payload is the string's own bytes, which SQLite
//! hands back with one copy and never scans (docs/BENCHMARKS.md, twenty-fifth session).
//!
//! SQLite takes a BLOB argument as JSONB when its outer element's header and size
//! account for exactly its bytes; one whose first byte could also begin JSON text
//! (`[`, `{`, a digit: here an array of five or seven bytes) and whose payload is at
//! most seven bytes is checked element by element as well, and what is written here
//! passes that check too (the tests read such rows back).

// The element types written here, as JSONB numbers them.
/// JSON's `null`, without a payload.
const NULL: u8 = 0x0;
/// An integer, its payload the integer's decimal text.
const INTEGER: u8 = 0x3;
/// Text as it is: SQLite escapes it itself if it ever renders it as JSON text.
const TEXT_RAW: u8 = 0xA;
/// An array, its payload its elements one after the other.
const ARRAY: u8 = 0xB;

/// A value a row can hold, written as one JSONB element.
pub(crate) trait Element {
    fn write_to(&self, out: &mut Vec<u8>);
}

impl Element for str {
    fn write_to(&self, out: &mut Vec<u8>) {
        push_header(out, TEXT_RAW, self.len());
        out.extend_from_slice(self.as_bytes());
    }
}

impl<T: Element + ?Sized> Element for &T {
    fn write_to(&self, out: &mut Vec<u8>) {
        (**self).write_to(out);
    }
}

impl<T: Element> Element for Option<T> {
    fn write_to(&self, out: &mut Vec<u8>) {
        match self {
            Some(value) => value.write_to(out),
            None => out.push(NULL),
        }
    }
}

macro_rules! integer_elements {
    ($($integer:ty),*) => {$(
        impl Element for $integer {
            fn write_to(&self, out: &mut Vec<u8>) {
                let mut digits = itoa::Buffer::new();
                let text = digits.format(*self);
                push_header(out, INTEGER, text.len());
                out.extend_from_slice(text.as_bytes());
            }
        }
    )*};
}

integer_elements!(i64, u16, usize);

impl<T: Element> Element for [T] {
    fn write_to(&self, out: &mut Vec<u8>) {
        write_array(out, |out| {
            self.iter().for_each(|element| element.write_to(out))
        });
    }
}

impl<T: Element> Element for Vec<T> {
    fn write_to(&self, out: &mut Vec<u8>) {
        self.as_slice().write_to(out);
    }
}

/// A tuple is a row: an array of its fields.
macro_rules! tuple_elements {
    ($(($($field:ident),+)),*) => {$(
        impl<$($field: Element),+> Element for ($($field,)+) {
            #[allow(non_snake_case)]
            fn write_to(&self, out: &mut Vec<u8>) {
                let ($($field,)+) = self;
                write_array(out, |out| { $($field.write_to(out);)+ });
            }
        }
    )*};
}

tuple_elements!(
    (A, B),
    (A, B, C),
    (A, B, C, D),
    (A, B, C, D, E),
    (A, B, C, D, E, F)
);

/// The rows as one JSONB array: the value of a `jsonb_each` parameter.
pub(crate) fn array_of<Row: Element>(rows: impl IntoIterator<Item = Row>) -> Vec<u8> {
    let mut out = Vec::new();
    write_array(&mut out, |out| {
        rows.into_iter().for_each(|row| row.write_to(out));
    });
    out
}

/// The widest header: the type's byte and a size of eight bytes.
const WIDEST_HEADER_BYTES: usize = 9;

/// An array's elements, then its header in front of them: the header's width depends
/// on the payload's size, known only once the elements are written, so they are
/// written after room for the widest header and moved back to close the gap.
fn write_array(out: &mut Vec<u8>, write_elements: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.resize(start + WIDEST_HEADER_BYTES, 0);
    write_elements(out);
    let payload_bytes = out.len() - start - WIDEST_HEADER_BYTES;
    let (header, header_bytes) = header_of(ARRAY, payload_bytes);
    let payload_start = start + header_bytes;
    out[start..payload_start].copy_from_slice(&header[..header_bytes]);
    out.copy_within(start + WIDEST_HEADER_BYTES.., payload_start);
    out.truncate(payload_start + payload_bytes);
}

fn push_header(out: &mut Vec<u8>, element_type: u8, payload_bytes: usize) {
    let (header, header_bytes) = header_of(element_type, payload_bytes);
    out.extend_from_slice(&header[..header_bytes]);
}

/// An element's header and how many of its bytes it uses: the type in the low four
/// bits; a payload of up to eleven bytes gives its size in the high four, a longer one
/// the width of the big-endian size that follows (12: one byte, 13: two, 14: four, 15:
/// eight).
fn header_of(element_type: u8, payload_bytes: usize) -> ([u8; WIDEST_HEADER_BYTES], usize) {
    let mut header = [0; WIDEST_HEADER_BYTES];
    let payload_bytes = payload_bytes as u64;
    if payload_bytes <= 11 {
        header[0] = ((payload_bytes as u8) << 4) | element_type;
        return (header, 1);
    }
    let (width, size_bytes) = match payload_bytes {
        0..=0xFF => (12, 1),
        0x100..=0xFFFF => (13, 2),
        0x1_0000..=0xFFFF_FFFF => (14, 4),
        // Written as the format says, though SQLite reads no size above 32 bits and
        // binds no BLOB that long: such a statement fails, and writes nothing.
        _ => (15, 8),
    };
    header[0] = (width << 4) | element_type;
    header[1..=size_bytes].copy_from_slice(&payload_bytes.to_be_bytes()[8 - size_bytes..]);
    (header, 1 + size_bytes)
}

#[cfg(test)]
mod tests {
    use super::array_of;

    #[test]
    fn headers_take_the_narrowest_size_that_holds_the_payload() {
        assert_eq!(array_of(Vec::<i64>::new()), [0x0B]);
        assert_eq!(array_of([None::<&str>]), [0x1B, 0x00]);
        assert_eq!(array_of([-12_i64]), [0x4B, 0x33, b'-', b'1', b'2']);
        let eleven = "a".repeat(11);
        let written = array_of([eleven.as_str()]);
        assert_eq!(&written[..2], [0xCB, 12]);
        assert_eq!(written[2], 0xBA);
        let twelve = "b".repeat(12);
        let written = array_of([twelve.as_str()]);
        assert_eq!(&written[..4], [0xCB, 14, 0xCA, 12]);
        let long = "c".repeat(300);
        let written = array_of([long.as_str()]);
        assert_eq!(&written[..6], [0xDB, 0x01, 0x2F, 0xDA, 0x01, 0x2C]);
        assert_eq!(written.len(), 6 + 300);
        let huge = "d".repeat(70_000);
        let written = array_of([huge.as_str()]);
        assert_eq!(&written[..5], [0xEB, 0x00, 0x01, 0x11, 0x75]);
        assert_eq!(&written[5..10], [0xEA, 0x00, 0x01, 0x11, 0x70]);
    }

    #[test]
    fn rows_are_arrays_of_their_fields_in_order() {
        let written = array_of([("a", 7_usize), ("", 10_000)]);
        let expected = [
            0xCB, 13, // the outer array, 13 bytes
            0x4B, 0x1A, b'a', 0x13, b'7', // ["a", 7]
            0x7B, 0x0A, 0x53, b'1', b'0', b'0', b'0', b'0', // ["", 10000]
        ];
        assert_eq!(written, expected);
        assert_eq!(
            array_of([vec!["x"], vec![]]),
            [0x4B, 0x2B, 0x1A, b'x', 0x0B]
        );
    }
}
