//! Metadata values as a GGUF file stores them: thirteen value types, numbered 0..=12 in the file,
//! of which an array holds elements of one type (arrays of arrays included, each inner array with
//! its own element type).

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// An unsigned 8-bit integer.
    U8(u8),
    /// A signed 8-bit integer.
    I8(i8),
    /// An unsigned 16-bit integer.
    U16(u16),
    /// A signed 16-bit integer.
    I16(i16),
    /// An unsigned 32-bit integer.
    U32(u32),
    /// A signed 32-bit integer.
    I32(i32),
    /// A 32-bit float.
    F32(f32),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array.
    Array(Array),
    /// An unsigned 64-bit integer.
    U64(u64),
    /// A signed 64-bit integer.
    I64(i64),
    /// A 64-bit float.
    F64(f64),
}

/// An array value: its elements, all of the type the file names for them.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    /// Unsigned 8-bit integers.
    U8(Vec<u8>),
    /// Signed 8-bit integers.
    I8(Vec<i8>),
    /// Unsigned 16-bit integers.
    U16(Vec<u16>),
    /// Signed 16-bit integers.
    I16(Vec<i16>),
    /// Unsigned 32-bit integers.
    U32(Vec<u32>),
    /// Signed 32-bit integers.
    I32(Vec<i32>),
    /// 32-bit floats.
    F32(Vec<f32>),
    /// Booleans.
    Bool(Vec<bool>),
    /// Strings.
    String(Vec<String>),
    /// Arrays.
    Array(Vec<Array>),
    /// Unsigned 64-bit integers.
    U64(Vec<u64>),
    /// Signed 64-bit integers.
    I64(Vec<i64>),
    /// 64-bit floats.
    F64(Vec<f64>),
}

/// A value type number of the file format (`gguf_type` in `gguf.h`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The type numbered `id` in the file, or `None` past 12.
    pub(crate) fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The fewest bytes one value of this type takes in the file: a string is at least its 8-byte
    /// length, an array at least its 4-byte element type and 8-byte length.
    pub(crate) fn min_bytes(self) -> usize {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }

    /// The type's name as `gguf.cpp` spells it.
    pub(crate) fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "str",
            Array => "arr",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

impl Value {
    /// The value's type in words: `u32`, `str`, `arr[str]`, `arr[arr]`.
    pub fn type_name(&self) -> String {
        match self {
            Value::Array(a) => format!("arr[{}]", a.element_type().name()),
            _ => self.value_type().name().to_string(),
        }
    }

    pub(crate) fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// The value as an `i128` if it is an integer of any width (for the range-checked getters).
    pub(crate) fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }
}

impl Array {
    /// How many elements the array holds.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    /// Whether the array holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The type's name in words: `arr[f32]`.
    pub fn type_name(&self) -> String {
        format!("arr[{}]", self.element_type().name())
    }

    pub(crate) fn element_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }
}
