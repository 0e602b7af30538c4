//! Reading the metadata key-value pairs: each a string key, a u32 value type and a value. Keys are
//! non-empty, UTF-8 and unique; strings are UTF-8; bools are 0 or 1; arrays nest at most
//! [`GgufFile::MAX_ARRAY_DEPTH`] deep; every length is checked against the bytes left before it
//! is allocated. Then `general.alignment`, if present, must be a u32 power of two.

use crate::GgufFile;
use crate::cursor::Cursor;
use crate::error::{GgufError, Result};
use crate::text::{cut, quote};
use crate::value::{Array, Value, ValueType};
use std::collections::HashMap;

/// The key that sets the data section's alignment.
pub(crate) const ALIGNMENT_KEY: &str = "general.alignment";

/// The alignment when [`ALIGNMENT_KEY`] is absent.
pub(crate) const DEFAULT_ALIGNMENT: usize = 32;

/// The parsed key-value pairs.
pub(crate) struct Metadata {
    /// In file order.
    pub(crate) entries: Vec<(String, Value)>,
    /// Each key's index in `entries`.
    pub(crate) index: HashMap<String, usize>,
    /// From `general.alignment`, or the default.
    pub(crate) alignment: usize,
}

/// Where in a value an error is: the key, and the element indices down nested arrays.
struct Place<'k> {
    key: &'k str,
    elements: Vec<usize>,
}

impl Place<'_> {
    /// `the value of key "k"`, or `element [2][0] of key "k"` inside arrays.
    fn describe(&self) -> String {
        if self.elements.is_empty() {
            return format!("the value of key {}", quote(self.key));
        }
        let indices: String = self.elements.iter().map(|i| format!("[{i}]")).collect();
        format!("element {indices} of key {}", quote(self.key))
    }
}

/// Reads `n_kv` key-value pairs and the alignment they set.
pub(crate) fn read_metadata(c: &mut Cursor, n_kv: usize) -> Result<Metadata> {
    let mut entries = Vec::new();
    let mut index = HashMap::new();
    // The byte offset of each entry, then of its value.
    let mut starts = Vec::new();
    let mut value_at = Vec::new();
    for i in 0..n_kv {
        let start = c.offset();
        let (key, _) = c.string(&|| format!("the key of metadata entry {i}"))?;
        if key.is_empty() {
            return Err(GgufError::EmptyKey { path: c.path.to_string(), index: i as u64, offset: start });
        }
        if let Some(&first) = index.get(&key) {
            let first = starts[first];
            return Err(GgufError::DuplicateKey { path: c.path.to_string(), key: cut(&key), offset: start, first });
        }
        let type_at = c.offset();
        let type_id = c.u32(&|| format!("the value type of key {}", quote(&key)))?;
        let Some(vtype) = ValueType::from_id(type_id) else {
            let what = format!("the value type of key {}", quote(&key));
            return Err(GgufError::UnknownValueType { path: c.path.to_string(), what, offset: type_at, type_id });
        };
        value_at.push(c.offset());
        let value = read_value(c, vtype, &mut Place { key: &key, elements: Vec::new() })?;
        starts.push(start);
        index.insert(key.clone(), entries.len());
        entries.push((key, value));
    }
    let alignment = match index.get(ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some(&i) => match entries[i].1 {
            Value::U32(a) if a.is_power_of_two() => a as usize,
            Value::U32(a) => {
                return Err(GgufError::BadAlignment { path: c.path.to_string(), alignment: a, offset: value_at[i] });
            }
            ref other => {
                let (path, found) = (c.path.to_string(), other.type_name());
                return Err(GgufError::AlignmentType { path, found, offset: value_at[i] });
            }
        },
    };
    Ok(Metadata { entries, index, alignment })
}

/// Little-endian numbers of type `$t`, `$n` of them (the count already checked to fit).
macro_rules! numbers {
    ($c:expr, $n:expr, $t:ty, $what:expr) => {{
        const W: usize = std::mem::size_of::<$t>();
        $c.take($n * W, $what)?
            .chunks_exact(W)
            .map(|b| {
                let mut a = [0u8; W];
                a.copy_from_slice(b);
                <$t>::from_le_bytes(a)
            })
            .collect::<Vec<$t>>()
    }};
}

/// One bool: a byte that must be 0 or 1.
fn read_bool(c: &mut Cursor, place: &Place) -> Result<bool> {
    let at = c.offset();
    match c.u8(&|| place.describe())? {
        0 => Ok(false),
        1 => Ok(true),
        byte => Err(GgufError::BadBool { path: c.path.to_string(), what: place.describe(), offset: at, byte }),
    }
}

/// One value of type `vtype`.
fn read_value(c: &mut Cursor, vtype: ValueType, place: &mut Place) -> Result<Value> {
    let what = || place.describe();
    Ok(match vtype {
        ValueType::U8 => Value::U8(c.u8(&what)?),
        ValueType::I8 => Value::I8(i8::from_le_bytes(c.array(&what)?)),
        ValueType::U16 => Value::U16(u16::from_le_bytes(c.array(&what)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(c.array(&what)?)),
        ValueType::U32 => Value::U32(c.u32(&what)?),
        ValueType::I32 => Value::I32(i32::from_le_bytes(c.array(&what)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(c.array(&what)?)),
        ValueType::Bool => Value::Bool(read_bool(c, place)?),
        ValueType::String => Value::String(c.string(&what)?.0),
        ValueType::U64 => Value::U64(c.u64(&what)?),
        ValueType::I64 => Value::I64(i64::from_le_bytes(c.array(&what)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(c.array(&what)?)),
        ValueType::Array => Value::Array(read_array(c, place, 1)?),
    })
}

/// An array at nesting level `depth` (1 for a key's own value): its element type, its length and
/// its elements.
fn read_array(c: &mut Cursor, place: &mut Place, depth: usize) -> Result<Array> {
    let at = c.offset();
    if depth > GgufFile::MAX_ARRAY_DEPTH {
        let (path, what) = (c.path.to_string(), place.describe());
        return Err(GgufError::ArrayTooDeep { path, what, offset: at, max: GgufFile::MAX_ARRAY_DEPTH });
    }
    let type_id = c.u32(&|| format!("the element type of {}", place.describe()))?;
    let Some(elem) = ValueType::from_id(type_id) else {
        let (path, what) = (c.path.to_string(), format!("the element type of {}", place.describe()));
        return Err(GgufError::UnknownValueType { path, what, offset: at, type_id });
    };
    let n = c.count(elem.min_bytes(), &|| format!("the length of {}", place.describe()))?;
    let what = || place.describe();
    Ok(match elem {
        ValueType::U8 => Array::U8(c.take(n, &what)?.to_vec()),
        ValueType::I8 => Array::I8(numbers!(c, n, i8, &what)),
        ValueType::U16 => Array::U16(numbers!(c, n, u16, &what)),
        ValueType::I16 => Array::I16(numbers!(c, n, i16, &what)),
        ValueType::U32 => Array::U32(numbers!(c, n, u32, &what)),
        ValueType::I32 => Array::I32(numbers!(c, n, i32, &what)),
        ValueType::F32 => Array::F32(numbers!(c, n, f32, &what)),
        ValueType::U64 => Array::U64(numbers!(c, n, u64, &what)),
        ValueType::I64 => Array::I64(numbers!(c, n, i64, &what)),
        ValueType::F64 => Array::F64(numbers!(c, n, f64, &what)),
        // Element by element, each pushed as it is read: a String or an inner Array takes more
        // memory than its bytes in the file, so nothing is reserved from the count alone.
        ValueType::Bool => Array::Bool(each(n, place, |place| read_bool(c, place))?),
        ValueType::String => Array::String(each(n, place, |place| Ok(c.string(&|| place.describe())?.0))?),
        ValueType::Array => Array::Array(each(n, place, |place| read_array(c, place, depth + 1))?),
    })
}

/// `n` elements read by `one`, each with its index on `place`.
fn each<T>(n: usize, place: &mut Place, mut one: impl FnMut(&mut Place) -> Result<T>) -> Result<Vec<T>> {
    let mut out = Vec::new();
    for j in 0..n {
        place.elements.push(j);
        out.push(one(place)?);
        place.elements.pop();
    }
    Ok(out)
}
