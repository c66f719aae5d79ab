"""The package's import graph, read from the source (`ast`), nothing imported.

Imports point one way: no cycle among flaxformer_lite's modules, counting
the imports that run when a module is imported (its module level). Inside
flaxformer_lite/attention/ no function imports a flaxformer_lite module:
an import moved into a function only hides a cycle until its first call.
"""
import ast
import pathlib

import flaxformer_lite

PACKAGE = pathlib.Path(flaxformer_lite.__file__).parent
NAME = PACKAGE.name

# (module, imported module) -> why this function-level import must stay. Empty:
# a new entry needs a reason that is not a cycle.
FUNCTION_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, pathlib.Path]:
  """Dotted name -> file, for every module of the package."""
  out = {}
  for path in PACKAGE.rglob('*.py'):
    parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
    out['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = path
  return out


MODULES = _modules()


def _package_of(module: str) -> str:
  return module if MODULES[module].name == '__init__.py' else module.rpartition('.')[0]


def _ancestors(module: str) -> list[str]:
  parts = module.split('.')
  return ['.'.join(parts[:i]) for i in range(1, len(parts))]


def _targets(module: str, node) -> list[str]:
  """The package's modules that `node` (an Import or ImportFrom in `module`)
  runs: the named module, and its packages above the importer's own."""
  if isinstance(node, ast.Import):
    named = [alias.name for alias in node.names]
  else:
    base = node.module or ''
    if node.level:
      up = _package_of(module).split('.')[:len(_package_of(module).split('.')) - node.level + 1]
      base = '.'.join(up + ([base] if base else []))
    subs = [f'{base}.{alias.name}' for alias in node.names if f'{base}.{alias.name}' in MODULES]
    named = subs + ([base] if len(subs) < len(node.names) else [])
  out = []
  for name in named:
    while name and name not in MODULES:  # `import a.b.C`: C is a name, a.b the module
      name = name.rpartition('.')[0]
    if not name or name == module:
      continue
    out += [m for m in [*_ancestors(name), name]
            if m not in _ancestors(module) and m != module and m.split('.')[0] == NAME]
  return out


def _is_type_checking(node) -> bool:
  test = node.test
  return isinstance(node, ast.If) and (getattr(test, 'id', None) == 'TYPE_CHECKING'
                                       or getattr(test, 'attr', None) == 'TYPE_CHECKING')


def _imports(module: str):
  """(module-level targets, [(line, target)] of imports inside functions)."""
  top, inner = set(), []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.If) and _is_type_checking(child) and not in_function:
        continue  # never runs
      nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                 ast.Lambda))
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        for target in _targets(module, child):
          if nested:
            inner.append((child.lineno, target))
          else:
            top.add(target)
      visit(child, nested)

  visit(ast.parse(MODULES[module].read_text()), False)
  return top, inner


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def connect(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while not component or component[-1] != v:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      connect(v)
  return found


def _one_cycle(graph, component) -> list[str]:
  """A shortest path back to component[0] inside the component, for the message."""
  start, members = component[0], set(component)
  paths, seen = [[start]], {start}
  while paths:
    path = paths.pop(0)
    for w in sorted(graph[path[-1]] & members):
      if w == start:
        return path + [start]
      if w not in seen:
        seen.add(w)
        paths.append(path + [w])
  return component


def test_the_finder_sees_a_cycle_and_a_clean_graph():
  graph = {'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}
  assert _cycles(graph) == [['a', 'b', 'c']]
  assert _one_cycle(graph, ['a', 'b', 'c']) == ['a', 'b', 'c', 'a']
  assert _cycles({'a': {'b'}, 'b': set()}) == []


def test_the_reader_resolves_submodules_names_and_parent_packages():
  top, _ = _imports(f'{NAME}.attention.schemes.dot_product')
  assert f'{NAME}.attention.registry' in top
  assert f'{NAME}.attention' not in top  # its own package: being imported already
  top, _ = _imports(f'{NAME}.layers.attention')
  assert f'{NAME}.attention' in top  # importing a module there runs attention/__init__


def test_no_cycle_among_the_packages_modules():
  graph = {module: _imports(module)[0] for module in MODULES}
  cycles = [' -> '.join(_one_cycle(graph, c)) for c in _cycles(graph)]
  assert not cycles, ('module-level imports in a circle (move what both sides need into '
                      'a module of its own): ' + '; '.join(cycles))


def test_no_function_in_attention_imports_a_package_module():
  found = [f'{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {target}'
           for module in sorted(MODULES) if module.startswith(f'{NAME}.attention')
           for line, target in _imports(module)[1]
           if (module, target) not in FUNCTION_IMPORTS_ALLOWED]
  assert not found, 'imports inside functions: ' + '; '.join(found)


MAX_FUNCTION_LINES = 80


def test_no_function_in_attention_is_longer_than_a_screen():
  """A reader finds any scheme's or kernel's step in one screen."""
  long = []
  for module, path in sorted(MODULES.items()):
    if not module.startswith(f'{NAME}.attention'):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
          long.append(f'{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines})')
  assert not long, f'functions over {MAX_FUNCTION_LINES} lines: ' + '; '.join(long)
